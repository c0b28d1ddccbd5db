"""Measured CPU collectives: an alpha-beta fit, and a check of the scale model.

Run: python -m benchmarks.collectives [--quick] [--traffic FILE] [--out FILE]

1. Times ``psum`` (all-reduce), ``all_gather`` and ``ppermute``
   (collective-permute) of float32 buffers (op results from 4 KB to 64 MB) on
   ``n`` forced CPU devices, and fits ``t = alpha + ring_bytes / beta`` per
   op kind (least squares on relative error), ``ring_bytes`` from `exdyna_jax.hlo`.
2. Replays each method's collectives, exactly as counted in the compiled step
   (``traffic.json``, ``N = 11.2M``, ``n = 8``), in one program of the same
   ops and shapes chained one after the other, times it, and compares with
   the sum the alpha-beta model predicts from the fitted constants.

On this machine the "network" is shared memory and the devices share the
cores, so the fitted constants describe nothing physical; what the check
tests is the model's structure: cost additive over ops, linear in the ring
bytes, a fixed cost per op.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from benchmarks import _common
from exdyna_jax import hlo

_common.force_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import P  # noqa: E402

AXIS = _common.AXIS


def _time(fn, args, repeats):
  jax.block_until_ready(fn(*args))
  _, times = _common.blocked_seconds(lambda _: fn(*args), None, repeats)
  return statistics.median(times)


def _collective(op: dict, n: int):
  """``x -> op(x)`` and the per-worker input length (float32) of one HLO op."""
  elements = max(1, op["result_bytes"] // 4)
  kind = op["kind"]
  if kind == "all-reduce":
    return (lambda x: jax.lax.psum(x, AXIS)), elements
  if kind == "all-gather":
    return (lambda x: jax.lax.all_gather(x, AXIS, tiled=True)), max(1, elements // op["group"])
  if kind == "collective-permute":
    perm = [(i, (i + 1) % n) for i in range(n)]
    return (lambda x: jax.lax.ppermute(x, AXIS, perm)), elements
  if kind == "all-to-all":
    return (lambda x: jax.lax.all_to_all(x, AXIS, 0, 0, tiled=True)), elements
  raise ValueError(kind)


def replay(ops: list[dict], n: int, repeats: int) -> float:
  """Median seconds of a program running ``ops`` one after the other."""
  mesh = _common.mesh_of(n)
  steps = [_collective(op, n) for op in ops]
  lengths = [length for _, length in steps]

  def program(*buffers):
    dep = jnp.zeros((), jnp.float32)
    outs = []
    for (fn, _), buf in zip(steps, buffers, strict=True):
      out = fn(buf + dep)  # the data dependency serialises the ops
      dep = out.reshape(-1)[0] * 0.0
      outs.append(out[:1])
    return outs

  sharded = jax.NamedSharding(mesh, P(AXIS))
  buffers = [jax.device_put(jnp.ones((n * length,), jnp.float32), sharded) for length in lengths]
  fn = jax.jit(
    jax.shard_map(
      program,
      mesh=mesh,
      in_specs=(P(AXIS),) * len(ops),
      out_specs=[P(AXIS)] * len(ops),
      check_vma=False,
    )
  )
  return _time(fn, buffers, repeats)


def fit(points: list[tuple[float, float]]) -> dict[str, float]:
  """``t = alpha + bytes / beta`` by least squares on relative error."""
  x = np.array([p[0] for p in points])
  t = np.array([p[1] for p in points])
  design = np.stack([np.ones_like(x), x], axis=1) / t[:, None]
  (alpha, per_byte), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
  predicted = alpha + per_byte * x
  return {
    "alpha_seconds": float(alpha),
    "beta_bytes_per_second": float(1.0 / per_byte) if per_byte > 0 else float("inf"),
    "median_abs_relative_error": float(np.median(np.abs(predicted / t - 1))),
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--workers", type=int, default=8)
  parser.add_argument("--traffic", default=str(_common.RESULTS / "traffic.json"))
  parser.add_argument("--out", default=str(_common.RESULTS / "collectives.json"))
  args = parser.parse_args()
  n = args.workers
  repeats = 5 if args.quick else 9
  sizes = [2**10, 2**14, 2**18, 2**22] if args.quick else [2**10, 2**13, 2**16, 2**19, 2**22, 2**24]
  largest = 2**26  # bytes of an op's result: 64 MiB covers dense at N = 11.2M
  clock = _common.Clock()
  samples, fits = [], {}
  for kind in ("all-reduce", "all-gather", "collective-permute"):
    points = []
    for elements in sizes:
      result = elements * 4 * (n if kind == "all-gather" else 1)
      if result > largest:
        continue
      op = {"kind": kind, "result_bytes": result, "group": n}
      seconds = replay([op], n, repeats)
      ring = hlo.ring_cost(kind, result, n, pairs=n).bytes
      points.append((ring, seconds))
      samples.append({"kind": kind, "result_bytes": result, "ring_bytes": ring, "seconds": seconds})
      _common.log(f"[collectives {clock():4.0f}s] {kind} {result:>10} B  {seconds * 1e3:.3f} ms")
    fits[kind] = fit(points)
  checks = []
  try:
    with open(args.traffic) as f:
      traffic = json.load(f)
  except FileNotFoundError:
    traffic = {"rows": []}
  for row in traffic["rows"]:
    if row["workers"] != n or not row["ops"]:
      continue
    ops = [op for op in row["ops"] if op["kind"] in fits]
    predicted = sum(
      fits[op["kind"]]["alpha_seconds"] + op["bytes"] / fits[op["kind"]]["beta_bytes_per_second"]
      for op in ops
    )
    measured = replay(ops, n, repeats)
    checks.append(
      {
        "method": row["method"],
        "density": row["density"],
        "ops": len(ops),
        "ring_bytes": row["bytes"],
        "measured_seconds": measured,
        "predicted_seconds": predicted,
        "measured_over_predicted": measured / predicted,
      }
    )
    _common.log(
      f"[collectives {clock():4.0f}s] replay {row['method']} d={row['density']}: "
      f"measured {measured * 1e3:.2f} ms, predicted {predicted * 1e3:.2f} ms"
    )
  _common.write_json(
    args.out,
    {
      "benchmark": "collectives",
      "workers": n,
      "repeats": repeats,
      "samples": samples,
      "fits": fits,
      "replays": checks,
      "total_seconds": clock(),
    },
  )


if __name__ == "__main__":
  sys.exit(main())
