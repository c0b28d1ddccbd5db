"""Flax linen's MNIST CNN with a ``TrainState``, trained data parallel with ExDyna.

The single-device linen training script (a CNN with BatchNorm and Dropout, a
``TrainState`` subclass holding ``batch_stats``, a jitted step that returns
``state.apply_gradients(...)``), ported to 8 workers. The lines marked
``# data parallel`` are all that changed:

- a mesh, and ``exdyna_jax.sparse_adamw(chunked_topk(dgc_warmup(6 * density / 8,
  ...), value_bits=2), lr)`` for ``optax.adamw(lr, momentum)`` (the library's
  AdamW recipe: each worker sends its own largest ``6 density / 8`` of every
  4,096 coordinates in 2 bits, the bytes of about ``density`` in float32,
  after ten steps at 12.5 % and ten at 3.1 %;
  each worker's own second moment preconditions its gradient and the
  sparsifier's residual carries the momentum);
- ``exdyna_jax.create_train_state(dp, TrainState, ...)`` for
  ``TrainState.create(..., tx=tx)`` (its ``opt_state`` is each worker's own);
- ``@exdyna_jax.train_state_step(dp, reduce={"batch_stats": "mean"})`` for
  ``@jax.jit`` on the training step: each worker takes its share of the
  batch, and the BatchNorm statistics are averaged over the workers;
- the Dropout key folded with the worker's index, so each draws its own mask.

The evaluation step stays ``@jax.jit``: the parameters and statistics are
the same on every worker. The data is scikit-learn's bundled digits
upsampled to 28x28 (no download).

Run: python examples/linen_mnist.py [--steps 300] [--density 0.01]
(``--density``: the bytes of that share of the coordinates in float32.)
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state

import exdyna_jax  # data parallel

import _common


class CNN(nn.Module):
  """Two 3x3 convolutions with BatchNorm, average pooling, two dense layers, Dropout."""

  @nn.compact
  def __call__(self, x, train: bool):
    x = nn.Dropout(0.025, deterministic=not train)(nn.Conv(32, (3, 3))(x))
    x = nn.avg_pool(nn.relu(nn.BatchNorm(use_running_average=not train)(x)), (2, 2), (2, 2))
    x = nn.Conv(64, (3, 3))(x)
    x = nn.avg_pool(nn.relu(nn.BatchNorm(use_running_average=not train)(x)), (2, 2), (2, 2))
    x = nn.relu(nn.Dropout(0.025, deterministic=not train)(nn.Dense(256)(x.reshape(len(x), -1))))
    return nn.Dense(10)(x)


class TrainState(train_state.TrainState):
  batch_stats: Any


def cross_entropy(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def train(args: argparse.Namespace) -> dict[str, float]:
  """Trains the CNN for ``args.steps`` steps; returns the last metrics."""
  mesh = jax.make_mesh((jax.device_count(),), ("data",),  # data parallel
                       axis_types=(jax.sharding.AxisType.Auto,))  # data parallel
  model = CNN()
  train_ds, test_ds = _common.digit_images()
  variables = model.init(jax.random.key(0), train_ds["image"][:1], train=False)
  tx = exdyna_jax.sparse_adamw(exdyna_jax.chunked_topk(exdyna_jax.dgc_warmup(  # data parallel
      6 * args.density / mesh.size, steps_per_level=10, start=0.125),  # data parallel: warm-up
      value_bits=2), args.learning_rate)  # data parallel: the residual is the momentum
  dp = exdyna_jax.data_parallel(tx, mesh)  # data parallel
  state = exdyna_jax.create_train_state(  # data parallel
      dp, TrainState, apply_fn=model.apply, params=variables["params"],
      batch_stats=variables["batch_stats"])

  @exdyna_jax.train_state_step(dp, reduce={"batch_stats": "mean"})  # data parallel
  def train_step(state: TrainState, batch, key):
    key = jax.random.fold_in(key, jax.lax.axis_index("data"))  # data parallel

    def loss_fn(params):
      logits, updates = state.apply_fn(
          {"params": params, "batch_stats": state.batch_stats}, batch["image"], train=True,
          mutable=["batch_stats"], rngs={"dropout": jax.random.fold_in(key, state.step)})
      return cross_entropy(logits, batch["label"]), (logits, updates["batch_stats"])

    (loss, (logits, batch_stats)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    accuracy = jnp.mean(jnp.argmax(logits, -1) == batch["label"])
    return state.apply_gradients(grads=grads, batch_stats=batch_stats), loss, accuracy

  @jax.jit
  def eval_step(state: TrainState, batch):
    logits = state.apply_fn({"params": state.params, "batch_stats": state.batch_stats},
                            batch["image"], train=False)
    return cross_entropy(logits, batch["label"]), jnp.mean(jnp.argmax(logits, -1) == batch["label"])

  order, key = np.random.default_rng(args.seed), jax.random.key(args.seed)
  history, train_losses, train_accuracies = {}, [], []
  for step in range(1, args.steps + 1):
    chosen = order.integers(0, len(train_ds["label"]), args.batch_size)
    state, loss, accuracy = train_step(state, {k: v[chosen] for k, v in train_ds.items()}, key)
    train_losses.append(loss)  # one per worker: their mean is the step's
    train_accuracies.append(accuracy)
    if step % args.eval_every == 0 or step == args.steps:
      test_loss, test_accuracy = eval_step(state, test_ds)
      history.update(train_loss=float(jnp.mean(jnp.stack(train_losses))),
                     train_accuracy=float(jnp.mean(jnp.stack(train_accuracies))),
                     test_loss=float(test_loss), test_accuracy=float(test_accuracy))
      train_losses, train_accuracies = [], []
      print(f"step {step:4d}  train loss {history['train_loss']:.3f}  "
            f"test loss {history['test_loss']:.3f}  test accuracy {history['test_accuracy']:.2%}")
  totals = exdyna_jax.read_totals(dp.stats(state.opt_state))  # data parallel
  history["sent_share"] = totals["transmitted"] / (totals["target"] * mesh.size)  # data parallel
  print(f"{mesh.size} workers, sent/k {history['sent_share']:.3f}")  # data parallel: union / picks
  return history


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
  parser = _common.port_parser(__doc__.split("\n\n")[0])
  parser.add_argument("--density", type=float, default=0.01)  # data parallel
  return train(parser.parse_args(argv))


if __name__ == "__main__":
  jax.config.update("jax_num_cpu_devices", 8)  # data parallel: 8 CPU devices if no GPU
  main()
