"""Flax NNX with a per-worker train step wired by ``exdyna_jax.nnx_step``.

Trains an NNX MLP on scikit-learn's bundled digits, one worker per device (8
simulated on CPU), once with ``dense`` (plain all-reduce) and once with ExDyna, and prints test
accuracy and the bytes each worker sends per step (counted from the compiled
program's collectives).

The points to copy:

- ``exdyna_jax.nnx_optimizer(dp, model, wrt=nnx.Param)`` stands for
  ``nnx.Optimizer(model, tx, wrt=nnx.Param)``: the same object, its state
  each worker's own;
- ``@exdyna_jax.nnx_step(dp)`` stands for ``@nnx.jit``: the step, written as
  for one device, runs on every worker with its shard of the batch (a
  ``jax.shard_map`` with ``check_vma=False``, so no dense all-reduce is
  hidden in the gradient: the only collectives in the compiled step are the
  sparsifier's own, which this script checks), jitted, with the objects'
  arrays donated and put back. A model with BatchNorm or Dropout needs one
  more word: see ``examples/flax_mnist.py``.

Run: python examples/nnx_shard_map.py [--steps 300] [--density 0.01] [--method exdyna]
"""

from __future__ import annotations

import argparse
import pathlib
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

import exdyna_jax
from exdyna_jax import hlo

import _common

AXIS = "data"


class MLP(nnx.Module):
  """64 -> 256 -> 256 -> 10, ReLU."""

  def __init__(self, rngs: nnx.Rngs):
    self.hidden1 = nnx.Linear(64, 256, rngs=rngs)
    self.hidden2 = nnx.Linear(256, 256, rngs=rngs)
    self.output = nnx.Linear(256, 10, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = jax.nn.relu(self.hidden1(x))
    x = jax.nn.relu(self.hidden2(x))
    return self.output(x)


def loss_fn(model: MLP, x: jax.Array, y: jax.Array) -> jax.Array:
  return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


def train(method: str, args: argparse.Namespace, mesh: jax.sharding.Mesh,
          split: _common.Split, out_dir: pathlib.Path) -> dict[str, Any]:
  """Trains a fresh model with ``method``; returns its row of the table."""
  model = MLP(nnx.Rngs(args.seed))
  options = {} if method == "dense" else {"density": args.density}
  tx = optax.chain(
      exdyna_jax.get_sparsifier(method, axis_name=AXIS, **options),  # first: local gradients
      optax.sgd(args.learning_rate, momentum=args.momentum),
  )
  dp = exdyna_jax.data_parallel(tx, mesh, axis_name=AXIS)
  optimizer = exdyna_jax.nnx_optimizer(dp, model, wrt=nnx.Param)

  @exdyna_jax.nnx_step(dp)  # runs on every worker: its shard of the batch, its own state
  def train_step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
    optimizer.update(model, grads)  # sparsify + exchange, then SGD
    return loss

  rng = np.random.default_rng(args.seed)
  global_batch = mesh.size * args.batch_per_worker
  first = rng.integers(0, len(split.x_train), global_batch)
  lowered = train_step.lower(model, optimizer, split.x_train[first], split.y_train[first])
  hlo_bytes = hlo.bytes_per_worker(lowered.compile().as_text(), mesh.size)

  records, losses = [], []
  for t in range(1, args.steps + 1):
    idx = rng.integers(0, len(split.x_train), global_batch)
    worker_losses = train_step(model, optimizer, split.x_train[idx], split.y_train[idx])
    stats = dp.stats(optimizer.opt_state)
    losses.append(float(np.mean(worker_losses)))
    records.append({"step": t, "loss": losses[-1], "transmitted": int(stats.transmitted),
                  "threshold": float(stats.threshold), "bytes_sent": int(stats.bytes_sent)})
  _common.write_json_lines(out_dir / f"metrics-{method}.jsonl", records)

  accuracy = float(np.mean(np.argmax(model(split.x_test), -1) == split.y_test))
  return _common.example_row(method, accuracy, losses, hlo_bytes, int(stats.bytes_sent))


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
  return _common.digits_example(__doc__.split("\n\n")[0], "runs/nnx_shard_map", train, argv)


if __name__ == "__main__":
  jax.config.update("jax_num_cpu_devices", 8)  # before JAX starts its backend
  main()
