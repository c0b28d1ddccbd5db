"""How closely each threshold controller holds the target density.

Trains a small MLP on scikit-learn's bundled digits with n simulated workers
(jax.vmap with an axis name) and records K/k at every step, for the reference
and the adaptive controllers.

Run: python benchmarks/density_control.py [--steps 300] [--density 0.01]
"""

from __future__ import annotations

import argparse
import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits

import exdyna_jax

AXIS = "data"


def init_mlp(key, sizes):
  params = []
  for fan_in, fan_out in itertools.pairwise(sizes):
    key, sub = jax.random.split(key)
    params.append({
        "w": jax.random.normal(sub, (fan_in, fan_out)) * jnp.sqrt(2.0 / fan_in),
        "b": jnp.zeros((fan_out,)),
    })
  return params


def mlp(params, x):
  for layer in params[:-1]:
    x = jax.nn.relu(x @ layer["w"] + layer["b"])
  return x @ params[-1]["w"] + params[-1]["b"]


def loss_fn(params, x, y):
  logits = mlp(params, x)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def run(method_tx, *, steps, workers, batch, seed=0):
  digits = load_digits()
  x = jnp.asarray(digits.data / 16.0, jnp.float32)
  y = jnp.asarray(digits.target)
  params = init_mlp(jax.random.key(seed), [64, 256, 256, 10])
  tx = optax.chain(method_tx, optax.sgd(0.05, momentum=0.9))

  def worker_init(_):
    return tx.init(params)

  opt_state = jax.vmap(worker_init, axis_name=AXIS, axis_size=workers)(jnp.arange(workers))

  @jax.jit
  def train_step(params, opt_state, key):
    idx = jax.random.randint(key, (workers, batch), 0, x.shape[0])

    def per_worker(state, idx):
      grads = jax.grad(loss_fn)(params, x[idx], y[idx])
      updates, state = tx.update(grads, state, params)
      return updates, state

    updates, opt_state = jax.vmap(per_worker, axis_name=AXIS)(opt_state, idx)
    updates = jax.tree.map(lambda u: u[0], updates)
    return optax.apply_updates(params, updates), opt_state

  key = jax.random.key(seed + 1)
  ratios = []
  num_elements = sum(p.size for p in jax.tree.leaves(params))
  for _ in range(steps):
    key, sub = jax.random.split(key)
    params, opt_state = train_step(params, opt_state, sub)
    stats = exdyna_jax.get_stats(opt_state)
    ratios.append(float(stats.selected[0]))
  return np.asarray(ratios), num_elements


def summarize(selected, target, start=20):
  ratio = selected / target
  error = np.abs(ratio[start:] - 1)
  inside = np.nonzero(np.abs(ratio - 1) <= 0.05)[0]
  return {
      f"median_abs_error_after_{start}": float(np.median(error)),
      f"p90_abs_error_after_{start}": float(np.quantile(error, 0.9)),
      "first_step_within_5pct": int(inside[0]) if inside.size else None,
      "final_ratio": float(ratio[-1]),
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--density", type=float, default=0.01)
  parser.add_argument("--workers", type=int, default=8)
  parser.add_argument("--batch", type=int, default=32)
  parser.add_argument("--methods", default="exdyna")
  args = parser.parse_args()
  report = {}
  for method in args.methods.split(","):
    factory = getattr(exdyna_jax, method)
    for controller in ("reference", "adaptive"):
      tx = factory(args.density, controller=controller)
      selected, num_elements = run(tx, steps=args.steps, workers=args.workers, batch=args.batch)
      target = int(args.density * num_elements)
      report[f"{method}/{controller}"] = summarize(selected, target)
  print(json.dumps(report, indent=2))


if __name__ == "__main__":
  main()
