"""Flax NNX + ``nnx.Optimizer`` with an explicit ``jax.shard_map`` train step.

Trains an NNX MLP on scikit-learn's bundled digits with 8 simulated workers,
once with ``dense`` (plain all-reduce) and once with ExDyna, and prints test
accuracy and the bytes each worker sends per step (counted from the compiled
program's collectives).

The points to copy:

- the optimizer state is per worker (ExDyna's residual differs from worker
  to worker), so it is created *inside* ``shard_map`` and leaves it with a
  leading worker axis sharded over ``"data"``;
- ``check_vma=False`` keeps the gradient of the replicated parameters local:
  no dense all-reduce is hidden in ``nnx.grad``; the only collectives in the
  compiled step are ExDyna's own (this script checks it).

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
from jax import P

import exdyna_jax
from exdyna_jax.demo import data, report, traffic

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


def add_worker_axis(tree):
  return jax.tree.map(lambda leaf: leaf[None], tree)


def drop_worker_axis(tree):
  return jax.tree.map(lambda leaf: leaf[0], tree)


def train(method: str, args: argparse.Namespace, mesh: jax.sharding.Mesh,
          split: data.Split, out_dir: pathlib.Path) -> dict[str, Any]:
  """Trains a fresh model with ``method``; returns its row of the table."""
  model_graphdef, params = nnx.split(MLP(nnx.Rngs(args.seed)))
  params = jax.device_put(params, jax.sharding.NamedSharding(mesh, P()))
  options = {} if method == "dense" else {"density": args.density}
  tx = optax.chain(
      exdyna_jax.get_sparsifier(method, axis_name=AXIS, **options),  # first: local gradients
      optax.sgd(args.learning_rate, momentum=args.momentum),
  )

  optimizer_graphdef = None  # static structure of nnx.Optimizer, set while tracing init

  def init(params):
    nonlocal optimizer_graphdef
    optimizer = nnx.Optimizer(nnx.merge(model_graphdef, params), tx, wrt=nnx.Param)
    optimizer_graphdef, optimizer_state = nnx.split(optimizer)
    return add_worker_axis(optimizer_state)

  def train_step(params, optimizer_state, x, y):
    model = nnx.merge(model_graphdef, params)
    optimizer = nnx.merge(optimizer_graphdef, drop_worker_axis(optimizer_state))
    loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)  # this worker's own gradient
    optimizer.update(model, grads)  # sparsify + exchange, then SGD
    _, params = nnx.split(model)
    _, optimizer_state = nnx.split(optimizer)
    stats = exdyna_jax.get_stats(nnx.as_pure(optimizer.opt_state))  # the optax state inside
    return params, add_worker_axis(optimizer_state), loss[None], add_worker_axis(stats)

  optimizer_state = jax.jit(
      jax.shard_map(init, mesh=mesh, in_specs=P(), out_specs=P(AXIS))
  )(params)
  step = jax.jit(jax.shard_map(
      train_step, mesh=mesh,
      in_specs=(P(), P(AXIS), P(AXIS), P(AXIS)), out_specs=(P(), P(AXIS), P(AXIS), P(AXIS)),
      check_vma=False,  # keep gradients local; updates are identical on every worker
  ))

  rng = np.random.default_rng(args.seed)
  global_batch = mesh.size * args.batch_per_worker
  first = rng.integers(0, len(split.x_train), global_batch)
  compiled = step.lower(params, optimizer_state, split.x_train[first],
                        split.y_train[first]).compile()
  hlo_bytes = traffic.bytes_per_worker(compiled.as_text(), mesh.size)

  writer = report.JsonLinesWriter(out_dir / f"metrics-{method}.jsonl")
  losses = []
  for t in range(1, args.steps + 1):
    idx = rng.integers(0, len(split.x_train), global_batch)
    params, optimizer_state, worker_losses, stats = compiled(
        params, optimizer_state, split.x_train[idx], split.y_train[idx])
    stats = jax.tree.map(lambda s: np.asarray(s)[0], stats)  # worker 0's copy
    losses.append(float(np.mean(worker_losses)))
    writer.write({"step": t, "loss": losses[-1], "transmitted": int(stats.transmitted),
                  "threshold": float(stats.threshold), "bytes_sent": int(stats.bytes_sent)})
  writer.close()

  model = nnx.merge(model_graphdef, params)
  accuracy = float(np.mean(np.argmax(model(split.x_test), -1) == split.y_test))
  return report.example_row(method, accuracy, losses, hlo_bytes, int(stats.bytes_sent))


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
  parser = report.example_parser(__doc__.split("\n\n")[0], "runs/nnx_shard_map")
  args = parser.parse_args(argv)

  mesh = jax.make_mesh((8,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:8])
  split = data.load_digits_split()
  return report.compare(
      lambda method: train(method, args, mesh, split, args.out), args.method, args.out
  )


if __name__ == "__main__":
  jax.config.update("jax_num_cpu_devices", 8)  # before JAX starts its backend
  main()
