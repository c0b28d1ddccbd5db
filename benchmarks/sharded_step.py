"""A tensor-parallel train step on a ``(data, model)`` mesh: time, memory and the residual.

A 2.1M-parameter MLP (``D = 512``, ``H = 2048``; the first kernel split by
columns over ``"model"``, the second by rows, the bias replicated) on a
``(4, 2)`` mesh of the 8 forced CPU devices, ``chain(method, sgd)`` under
`data_parallel`, a batch of 64 (``--batch``). For Explicit model axes (``jax.make_mesh``'s
default: each device sparsifies its own shards) and Auto ones (the
sparsifier sees the whole gradient), dense and ExDyna at d = 0.01: the
median blocked step over ``--steps`` steps, each configuration timed
``--repeats`` times interleaved; the compiled step's
``memory_analysis()`` and its collectives (``collectives``); the residual a
device holds; the indices the timed steps sent over the ``k`` they asked
for, summed over the shards.

Run: python -m benchmarks.sharded_step [--repeats 3] [--steps 20] [--batch 64]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import P

import exdyna_jax
from benchmarks import _common
from exdyna_jax import hlo

D, H, BATCH, DENSITY = 512, 2048, 64, 0.01
SPECS = {"w1": P(None, "model"), "w2": P("model", None), "b": P()}


def loss_fn(params, batch):
  x, y = batch
  hidden = jnp.tanh(x @ params["w1"])
  return jnp.mean((jnp.matmul(hidden, params["w2"], out_sharding=P()) + params["b"] - y) ** 2)


def configuration(axis_type: str, method: str, batch: int = BATCH):
  """``(step, params, opt_state, batch, dp)`` of one configuration, compiled and warmed up."""
  kind = getattr(jax.sharding.AxisType, axis_type)
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(kind, kind))
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  params = {"w1": jax.random.normal(k1, (D, H)) / np.sqrt(D),
            "w2": jax.random.normal(k2, (H, D)) / np.sqrt(H), "b": jnp.zeros(D)}
  params = {name: jax.device_put(leaf, jax.NamedSharding(mesh, SPECS[name]))
            for name, leaf in params.items()}
  sparsifier = exdyna_jax.dense() if method == "dense" else exdyna_jax.exdyna(DENSITY)
  tx = optax.chain(sparsifier, optax.sgd(0.1))
  dp = exdyna_jax.data_parallel(tx, mesh)

  @dp.step
  def step(params, opt_state, batch):
    updates, opt_state = tx.update(jax.grad(loss_fn)(params, batch), opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  x = jax.random.normal(k3, (batch, D))
  opt_state = dp.init(params)
  for _ in range(3):
    params, opt_state = step(params, opt_state, (x, x))
  return step, params, opt_state, (x, x), dp


def timed(config, steps: int):
  step, params, opt_state, batch, dp = config
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    params, opt_state = step(params, opt_state, batch)
    jax.block_until_ready((params, opt_state))
    times.append(time.perf_counter() - start)
  return (step, params, opt_state, batch, dp), 1e3 * float(np.median(times))


def totals(config) -> dict:
  """The run's totals so far (`exdyna_jax.read_totals`), summed over the shards."""
  _, _, opt_state, _, dp = config
  return exdyna_jax.read_totals(dp.stats(opt_state))


def described(config, before: dict) -> dict:
  """Memory, the residual, and the sent/k of the steps since ``before`` (`totals`)."""
  step, params, opt_state, batch, _ = config
  compiled = step.lower(params, opt_state, batch).compile()
  memory = compiled.memory_analysis()
  residual = optax.tree.get(opt_state, "residual")
  after = totals(config)
  return {
      "sent_over_k": round((after["transmitted"] - before["transmitted"])
                           / (after["target"] - before["target"]), 4),
      "argument_MiB": round(memory.argument_size_in_bytes / 2**20, 2),
      "temp_MiB": round(memory.temp_size_in_bytes / 2**20, 2),
      "collectives": len(hlo.collectives(compiled.as_text(), jax.device_count())),
      "residual": None if residual is None else {
          "shape": list(residual.shape), "spec": str(residual.sharding.spec),
          "per_device_MiB": round(residual.addressable_shards[0].data.nbytes / 2**20, 2)},
  }


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--batch", type=int, default=BATCH, help="examples a step, all workers")
  parser.add_argument("--out", type=pathlib.Path,
                      default=_common.RESULTS / "sharded_step.json")
  args = parser.parse_args(argv)
  _common.force_devices(8)
  names = [(axis_type, method) for axis_type in ("Explicit", "Auto")
           for method in ("dense", "exdyna")]
  configs = {name: configuration(*name, args.batch) for name in names}
  warm = {name: totals(config) for name, config in configs.items()}
  medians = {name: [] for name in names}
  for _ in range(args.repeats):  # interleaved
    for name in names:
      configs[name], median = timed(configs[name], args.steps)
      medians[name].append(round(median, 1))
  rows = [{"axis_type": axis_type, "method": method, "step_ms": medians[(axis_type, method)],
           **described(configs[(axis_type, method)], warm[(axis_type, method)])}
          for axis_type, method in names]
  for row in rows:
    print(json.dumps(row))
  result = {"parameters": D * H * 2 + D, "density": DENSITY, "batch": args.batch, "rows": rows}
  _common.write_json(args.out, result)
  return result


if __name__ == "__main__":
  main()
