"""Update time per step of ExDyna vs a dense psum and a Top-k EF update.

Run: python benchmarks/update_cost.py [--elements N] [--density D] [--repeats R]

All methods run in one process on 8 forced CPU devices under jax.shard_map,
so the ratios are comparable; absolute times depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "")
import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import P  # noqa: E402

import exdyna_jax  # noqa: E402

AXIS = "data"


def _time(fn, args, repeats):
  out = fn(*args)
  jax.block_until_ready(out)
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    out = fn(*args)
    jax.block_until_ready(out)
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def _topk_update(grads, residual, k):
  """Top-k error feedback: lax.top_k + all_gather + psum + scatter."""
  accumulated = grads + residual
  _, indices = jax.lax.top_k(jnp.abs(accumulated), k)
  gathered = jax.lax.all_gather(indices, AXIS).reshape(-1)
  values = jax.lax.psum(accumulated[gathered], AXIS)
  n = jax.lax.axis_size(AXIS)
  update = jnp.zeros_like(accumulated).at[gathered].set(values / n)
  return update, accumulated.at[gathered].set(0)


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--elements", type=int, default=11_173_962)
  parser.add_argument("--density", type=float, default=0.001)
  parser.add_argument("--workers", type=int, default=8)
  parser.add_argument("--repeats", type=int, default=7)
  parser.add_argument("--warmup-steps", type=int, default=30)
  parser.add_argument("--skip-topk", action="store_true")
  args = parser.parse_args()
  n, num_elements = args.workers, args.elements
  mesh = jax.make_mesh((n,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:n])
  sharded = jax.NamedSharding(mesh, P(AXIS))
  key = jax.random.key(0)
  grads = jax.device_put(
      jax.random.normal(key, (n * num_elements,), jnp.float32) * 0.01, sharded)
  residual = jax.device_put(jnp.zeros((n * num_elements,), jnp.float32), sharded)

  def smap(fn, n_in, n_out):
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P(AXIS),) * n_in,
                                 out_specs=(P(AXIS),) * n_out if n_out > 1 else P(AXIS),
                                 check_vma=False))

  results = {}
  psum = smap(lambda g: jax.lax.psum(g, AXIS) / n, 1, 1)
  results["dense_psum"] = _time(psum, (grads,), args.repeats)
  floor = smap(lambda g, m: ((g + m) * 0.5, (g + m) * 0.25), 2, 2)
  results["elementwise_floor"] = _time(floor, (grads, residual), args.repeats)

  tx = exdyna_jax.exdyna(args.density)
  params = jnp.zeros((num_elements,), jnp.float32)

  def init(g):
    return jax.tree.map(lambda x: x[None], tx.init(params))

  def update(g, state):
    state = jax.tree.map(lambda x: x[0], state)
    updates, state = tx.update(g, state, params)
    return updates, jax.tree.map(lambda x: x[None], state)

  state = jax.jit(jax.shard_map(init, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))(grads)
  step = jax.jit(jax.shard_map(update, mesh=mesh, in_specs=(P(AXIS), P(AXIS)),
                               out_specs=(P(AXIS), P(AXIS)), check_vma=False),
                 donate_argnums=(1,))
  for _ in range(args.warmup_steps):  # let the controller settle
    _, state = step(grads, state)
  jax.block_until_ready(state)
  times = []
  for _ in range(args.repeats):
    start = time.perf_counter()
    updates, state = step(grads, state)
    jax.block_until_ready((updates, state))
    times.append(time.perf_counter() - start)
  results["exdyna"] = statistics.median(times)
  stats = jax.tree.map(lambda x: np.asarray(x)[0], state.stats)
  k = int(args.density * num_elements)
  if not args.skip_topk:
    topk = smap(lambda g, m: _topk_update(g, m, k), 2, 2)
    results["topk_ef"] = _time(topk, (grads, residual), max(3, args.repeats // 2))

  report = {
      "elements": num_elements, "workers": n, "density": args.density,
      "median_seconds": results,
      "exdyna_over_psum": results["exdyna"] / results["dense_psum"],
      "exdyna_over_floor": results["exdyna"] / results["elementwise_floor"],
      "selected_over_k": int(stats.selected) / k,
  }
  if "topk_ef" in results:
    report["topk_over_exdyna"] = results["topk_ef"] / results["exdyna"]
  print(json.dumps(report, indent=2))


if __name__ == "__main__":
  main()
