"""Per-worker traffic counted from the compiled program, and its memory.

Run: python -m benchmarks.traffic [--quick] [--out FILE]

For every registered method, density and worker count ``n``, the real step
(``jax.shard_map`` of ``tx.update`` on one flat float32 gradient of ``N``
elements per worker, state donated, as in training) is lowered and compiled
for ``n`` forced CPU devices -- nothing runs, so ``n`` can go to 1024. Every
collective in the compiled HLO is listed with its shapes and converted to
bytes sent per worker and messages with the ring model of `exdyna_jax.hlo` (bytes
received are equal). Dense ring all-reduce of ``N`` float32 is the reference:
``2 (n-1)/n * 4N``.

Cross-check: for ``n <= 16`` the method's own ``stats.bytes_sent`` is read
by running a program that returns only the stats (XLA removes the rest).

Memory: ``compiled.memory_analysis()`` of the same step at ``n = 8``
(argument, output, aliased and temporary bytes per device), against dense.
"""

from __future__ import annotations

import argparse
import sys
import time

from benchmarks import _common
from exdyna_jax import hlo

_common.force_devices(1024)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import P  # noqa: E402

import exdyna_jax  # noqa: E402

AXIS = _common.AXIS


def _shapes(num_workers: int, num_elements: int, name: str, density: float):
  """Abstract (grads, state, params) with shardings, and the jitted step."""
  init_fn, step_fn, mesh = _common.method_step(name, density, num_workers, num_elements)
  sharded = jax.NamedSharding(mesh, P(AXIS))
  params = jax.ShapeDtypeStruct((num_elements,), jnp.float32, sharding=jax.NamedSharding(mesh, P()))
  grads = jax.ShapeDtypeStruct((num_workers * num_elements,), jnp.float32, sharding=sharded)
  state = jax.tree.map(
    lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharded),
    jax.eval_shape(init_fn, params),
  )
  return grads, state, params, step_fn, init_fn, mesh


def op_row(op: hlo.Collective) -> dict:
  """One collective as ``traffic.json`` records it (``bytes`` per worker, ring model)."""
  return {"kind": op.kind, "shapes": [f"{t}[{','.join(map(str, dims))}]" for t, dims in op.shapes],
          "result_bytes": op.result_bytes, "group": op.group_size, "pairs": op.pairs,
          "context": op.context, "bytes": op.bytes_sent, "messages": op.messages,
          "log_messages": op.log_messages}


def measure_one(name: str, density: float, num_workers: int, num_elements: int) -> dict:
  """Collectives and (ring) traffic of one compiled step."""
  grads, state, params, step_fn, _, _ = _shapes(num_workers, num_elements, name, density)
  start = time.perf_counter()
  compiled = step_fn.lower(grads, state, params).compile()
  seconds = time.perf_counter() - start
  ops = hlo.collectives(compiled.as_text(), num_workers)
  result = {
    "method": name,
    "density": density,
    "workers": num_workers,
    "elements": num_elements,
    "compile_seconds": seconds,
    "ops": [op_row(op) for op in ops],
    **hlo.totals(ops),
  }
  if num_workers == 8:
    memory = compiled.memory_analysis()
    result["memory"] = {
      key: int(getattr(memory, f"{key}_size_in_bytes"))
      for key in ("argument", "output", "alias", "temp", "generated_code")
    }
  return result


def stats_bytes(name: str, density: float, num_workers: int, num_elements: int) -> int:
  """``stats.bytes_sent`` of one step, from a program that computes only the stats."""
  _, _, _, _, init_fn, mesh = _shapes(num_workers, num_elements, name, density)
  tx = _common.make_tx(name, density, num_workers)

  def bytes_sent(grads, state, params):
    state = jax.tree.map(lambda s: s[0], state)
    _, state = tx.update(grads, state, params)
    return exdyna_jax.get_stats(state).bytes_sent[None]

  sharded = jax.NamedSharding(mesh, P(AXIS))
  program = jax.jit(
    jax.shard_map(
      bytes_sent,
      mesh=mesh,
      in_specs=(P(AXIS), P(AXIS), P()),
      out_specs=P(AXIS),
      check_vma=False,
    )
  )
  params = jax.device_put(jnp.zeros((num_elements,), jnp.float32), jax.NamedSharding(mesh, P()))
  grads = jax.jit(
    lambda: jnp.zeros((num_workers * num_elements,), jnp.float32), out_shardings=sharded
  )()
  values = np.asarray(program(grads, init_fn(params), params))
  return int(values.max())


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--elements", type=int, default=_common.RESNET18)
  parser.add_argument("--out", default=str(_common.RESULTS / "traffic.json"))
  args = parser.parse_args()
  clock = _common.Clock()
  if args.quick:
    workers, checked, densities = [2, 4, 8, 16, 64], [2, 8], [0.001, 0.01]
  else:
    workers, checked = [2, 4, 8, 16, 64, 256, 1024], [2, 4, 8, 16]
    densities = [0.001, 0.01]
  rows = []
  for density in densities:
    for name in _common.METHODS:
      for n in workers:
        row = measure_one(name, density, n, args.elements)
        if n in checked:
          row["stats_bytes_sent"] = stats_bytes(name, density, n, args.elements)
        row["dense_ring_bytes"] = 2 * (n - 1) / n * 4 * args.elements
        rows.append(row)
        _common.log(
          f"[traffic {clock():5.0f}s] d={density} {name:>14} n={n:<5} "
          f"ring={row['bytes']:>14,.0f} B stats={row.get('stats_bytes_sent', '-')} "
          f"compile={row['compile_seconds']:.1f}s"
        )
  _common.write_json(
    args.out,
    {
      "benchmark": "traffic",
      "elements": args.elements,
      "workers": workers,
      "checked_workers": checked,
      "densities": densities,
      "total_seconds": clock(),
      "rows": rows,
    },
  )


if __name__ == "__main__":
  sys.exit(main())
