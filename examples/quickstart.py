"""Quick start: ExDyna in a per-worker train step wired by data_parallel, on 8 CPU devices.

Trains a small MLP on scikit-learn's bundled digits (no download) with 8
simulated workers, sending 1 % of the gradient per step, and prints what the
sparsifier did.

Run: python examples/quickstart.py [--steps 200] [--density 0.01]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits

import exdyna_jax

AXIS = "data"


def init_mlp(key, sizes=(64, 256, 256, 10)):
  keys = jax.random.split(key, len(sizes) - 1)
  return [
      {"w": jax.random.normal(k, (a, b)) * jnp.sqrt(2.0 / a), "b": jnp.zeros((b,))}
      for k, a, b in zip(keys, sizes[:-1], sizes[1:], strict=True)
  ]


def logits_fn(params, x):
  for layer in params[:-1]:
    x = jax.nn.relu(x @ layer["w"] + layer["b"])
  return x @ params[-1]["w"] + params[-1]["b"]


def loss_fn(params, x, y):
  return optax.softmax_cross_entropy_with_integer_labels(logits_fn(params, x), y).mean()


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--steps", type=int, default=200)
  parser.add_argument("--density", type=float, default=0.01)
  parser.add_argument("--batch-per-worker", type=int, default=32)
  args = parser.parse_args()

  digits = load_digits()
  x = (digits.data / 16.0).astype(np.float32)
  y = digits.target.astype(np.int32)
  x_train, y_train, x_test, y_test = x[:1500], y[:1500], x[1500:], y[1500:]

  n = jax.device_count()
  mesh = jax.make_mesh((n,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,))
  params = init_mlp(jax.random.key(0))
  # No momentum after the sparsifier: its residual carries it (0.05 / (1 - 0.9)).
  tx = optax.chain(exdyna_jax.exdyna(density=args.density), optax.sgd(0.5))

  dp = exdyna_jax.data_parallel(tx, mesh)

  # The step one worker runs: its shard of the batch, its own optimizer state
  # (its residual above all). dp.step wraps it in a jax.shard_map (with
  # check_vma=False, so the gradient of the replicated params stays local:
  # no hidden dense psum), jits it and donates the params and the state.
  @dp.step
  def step(params, opt_state, batch):
    x, y = batch
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)  # this worker's own gradient
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  opt_state = dp.init(params)  # every leaf: a leading worker axis sharded over the mesh

  rng = np.random.default_rng(0)
  num_elements = sum(leaf.size for leaf in jax.tree.leaves(params))
  target = int(args.density * num_elements)
  for t in range(args.steps):
    idx = rng.integers(0, len(x_train), n * args.batch_per_worker)
    params, opt_state, losses = step(params, opt_state, (x_train[idx], y_train[idx]))
    if t % 50 == 0 or t == args.steps - 1:
      stats = dp.stats(opt_state)  # the same on every worker: no worker axis
      print(
          f"step {t:4d}  loss {float(losses.mean()):.4f}"
          f"  sent {int(stats.transmitted):5d} / k={target}"
          f"  overflow {int(stats.overflow):4d}"
          f"  threshold {float(stats.threshold):.2e}"
          f"  imbalance {float(stats.imbalance):.2f}"
      )
  accuracy = float(jnp.mean(jnp.argmax(logits_fn(params, x_test), -1) == y_test))
  print(f"{n} workers, {num_elements} parameters, density {args.density}: "
        f"test accuracy {accuracy:.3f}")


if __name__ == "__main__":
  jax.config.update("jax_num_cpu_devices", 8)  # before JAX starts its backend
  main()
