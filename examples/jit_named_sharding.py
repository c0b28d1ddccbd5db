"""Plain ``jax.jit`` with ``NamedSharding`` (pjit style) via ``exdyna_jax.data_parallel``.

No ``shard_map`` in user code: the batch is sharded over the mesh axis
``"data"``, the parameters are replicated, and `exdyna_jax.data_parallel`
computes each worker's own gradient (no dense all-reduce) and places the
per-worker optimizer state, so no partition spec is written for it. Trains an
MLP on scikit-learn's bundled digits with ``dense`` and with ExDyna and
prints test accuracy and the bytes each worker sends per step (counted from
the compiled program).

Run: python examples/jit_named_sharding.py [--steps 300] [--density 0.01] [--method exdyna]
"""

from __future__ import annotations

import argparse
import pathlib
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

import exdyna_jax
from exdyna_jax import hlo

import _common

AXIS = "data"


def loss_fn(params, batch):
  x, y = batch
  return optax.softmax_cross_entropy_with_integer_labels(_common.mlp_logits(params, x), y).mean()


def train(method: str, args: argparse.Namespace, mesh: jax.sharding.Mesh,
          split: _common.Split, out_dir: pathlib.Path) -> dict[str, Any]:
  """Trains a fresh MLP with ``method``; returns its row of the table."""
  replicated = NamedSharding(mesh, PartitionSpec())
  batch_sharding = NamedSharding(mesh, PartitionSpec(AXIS))
  params = jax.device_put(_common.init_mlp(jax.random.key(args.seed), (64, 256, 256, 10)),
                          replicated)
  options = {} if method == "dense" else {"density": args.density}
  tx = optax.chain(
      exdyna_jax.get_sparsifier(method, axis_name=AXIS, **options),
      optax.sgd(args.learning_rate, momentum=args.momentum),
  )
  dp = exdyna_jax.data_parallel(tx, mesh, axis_name=AXIS)
  opt_state = jax.jit(dp.init)(params)  # every leaf: leading worker axis, sharded

  @jax.jit
  def train_step(params, opt_state, batch):
    loss, worker_grads = dp.value_and_grad(loss_fn)(params, batch)  # local gradients
    updates, opt_state = dp.update(worker_grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  rng = np.random.default_rng(args.seed)
  global_batch = mesh.size * args.batch_per_worker

  def next_batch():
    idx = rng.integers(0, len(split.x_train), global_batch)
    return jax.device_put((split.x_train[idx], split.y_train[idx]), batch_sharding)

  compiled = train_step.lower(params, opt_state, next_batch()).compile()
  hlo_bytes = hlo.bytes_per_worker(compiled.as_text(), mesh.size)
  rng = np.random.default_rng(args.seed)

  records, losses = [], []
  for t in range(1, args.steps + 1):
    params, opt_state, loss = compiled(params, opt_state, next_batch())
    stats = exdyna_jax.get_stats(opt_state)
    losses.append(float(loss))
    records.append({"step": t, "loss": losses[-1], "transmitted": int(stats.transmitted[0]),
                  "bytes_sent": int(stats.bytes_sent[0])})
  _common.write_json_lines(out_dir / f"metrics-{method}.jsonl", records)

  accuracy = float(np.mean(
      np.argmax(_common.mlp_logits(params, split.x_test), -1) == split.y_test))
  return _common.example_row(method, accuracy, losses, hlo_bytes, int(stats.bytes_sent[0]))


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
  return _common.digits_example(__doc__.split("\n\n")[0], "runs/jit_named_sharding", train, argv)


if __name__ == "__main__":
  jax.config.update("jax_num_cpu_devices", 8)  # before JAX starts its backend
  main()
