"""Flax linen ``TrainState`` with ``jax.pmap``.

``pmap`` gives each device its own copy of the state, so the per-worker
optimizer state (ExDyna's residual) needs nothing special: create the
``TrainState`` inside ``pmap`` (the sparsifier's ``init`` needs the axis
bound) and call ``state.apply_gradients`` on each worker's own gradient.
Trains a linen MLP on scikit-learn's bundled digits with ``dense`` and with
ExDyna and prints test accuracy and the bytes each worker sends per step
(counted from the compiled program).

Run: python examples/linen_pmap.py [--steps 300] [--density 0.01] [--method exdyna]
"""

from __future__ import annotations

import argparse
import pathlib
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training.train_state import TrainState

import exdyna_jax
from exdyna_jax import hlo

import _common

AXIS = "data"


class MLP(nn.Module):
  """64 -> 256 -> 256 -> 10, ReLU."""

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(256)(x))
    x = nn.relu(nn.Dense(256)(x))
    return nn.Dense(10)(x)


def train(method: str, args: argparse.Namespace, split: _common.Split,
          out_dir: pathlib.Path) -> dict[str, Any]:
  """Trains a fresh model with ``method``; returns its row of the table."""
  num_workers = jax.device_count()  # 8 forced CPU devices, or one worker per GPU
  model = MLP()
  params = model.init(jax.random.key(args.seed), jnp.zeros((1, 64)))["params"]
  options = {} if method == "dense" else {"density": args.density}
  tx = optax.chain(
      exdyna_jax.get_sparsifier(method, axis_name=AXIS, **options),
      optax.sgd(args.learning_rate, momentum=args.momentum),
  )

  def create_state(_):
    return TrainState.create(apply_fn=model.apply, params=params, tx=tx)

  state = jax.pmap(create_state, axis_name=AXIS)(jnp.arange(num_workers))

  def train_step(state, x, y):
    def loss_fn(params):
      logits = state.apply_fn({"params": params}, x)
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    loss, grads = jax.value_and_grad(loss_fn)(state.params)  # this worker's own gradient
    return state.apply_gradients(grads=grads), loss

  step = jax.pmap(train_step, axis_name=AXIS)

  rng = np.random.default_rng(args.seed)

  def next_batch():  # [workers, batch per worker, ...]
    idx = rng.integers(0, len(split.x_train), (num_workers, args.batch_per_worker))
    return split.x_train[idx], split.y_train[idx]

  hlo_bytes = hlo.bytes_per_worker(
      step.lower(state, *next_batch()).compile().as_text(), num_workers)
  rng = np.random.default_rng(args.seed)

  records, losses = [], []
  for t in range(1, args.steps + 1):
    state, worker_losses = step(state, *next_batch())
    stats = exdyna_jax.get_stats(state.opt_state)
    losses.append(float(jnp.mean(worker_losses)))
    records.append({"step": t, "loss": losses[-1], "transmitted": int(stats.transmitted[0]),
                  "bytes_sent": int(stats.bytes_sent[0])})
  _common.write_json_lines(out_dir / f"metrics-{method}.jsonl", records)

  params = jax.tree.map(lambda p: p[0], state.params)  # identical on every worker
  logits = model.apply({"params": params}, split.x_test)
  accuracy = float(np.mean(np.argmax(logits, -1) == split.y_test))
  return _common.example_row(method, accuracy, losses, hlo_bytes, int(stats.bytes_sent[0]))


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
  parser = _common.example_parser(__doc__.split("\n\n")[0], "runs/linen_pmap")
  args = parser.parse_args(argv)

  split = _common.load_digits_split()
  return _common.compare(lambda method: train(method, args, split, args.out), args.method, args.out)


if __name__ == "__main__":
  jax.config.update("jax_num_cpu_devices", 8)  # before JAX starts its backend
  main()
