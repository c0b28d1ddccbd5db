"""Where the ExDyna update spends its time: memory passes and timing variants.

Run: python -m benchmarks.profile_update [--quick] [--out FILE]

At the target configuration (``N = 11.2M``, ``n = 8``, ``d = 0.001``):

1. Static profile of the compiled per-device programs (the HLO that
   ``XLA_FLAGS=--xla_dump_to`` would dump, read from ``compiled.as_text()``):
   bytes read and written by every top-level op that touches an array of at
   least ``N / (2n)`` float32 -- the passes over the vector -- in units of
   ``4N`` bytes, for ExDyna, MiCRO, dense and the floor (which needs 4: read
   gradient and residual, write residual and update).
2. Timing variants, interleaved in one run as in ``cost.py``: ExDyna with
   the adaptive and the reference controller and with ``capacity_factor``
   1.0; MiCRO; dense with and without the non-finite guard
   (``patch=no_guard``: the guard's two functions swapped while tracing;
   library files untouched); Top-k with its ``k``-th magnitude read as a
   minimum (``patch=kth_min``) against the plain ``topk_ef``; dense psum and
   the floor. In ExDyna the guard is the one read of the gradient by the
   ``reduce_sum`` screen before ``a = g + m`` (section 1).
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
from jax import P

from benchmarks import _common, cost, hlo_memory

AXIS = _common.AXIS


def static_profile(num_elements: int, n: int, density: float) -> dict:
  """Passes over ``N`` of each compiled program, from its HLO."""
  mesh = _common.mesh_of(n)
  sharded = jax.NamedSharding(mesh, P(AXIS))
  grads = jax.ShapeDtypeStruct((n * num_elements,), jnp.float32, sharding=sharded)
  params = jax.ShapeDtypeStruct((num_elements,), jnp.float32, sharding=jax.NamedSharding(mesh, P()))
  programs = {}
  for name in ("exdyna", "micro", "dense", "dense:patch=no_guard"):
    method, _, patch = name.partition(":patch=")
    init_fn, step_fn, _ = _common.method_step(method, density, n, num_elements)
    state = jax.tree.map(
      lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharded),
      jax.eval_shape(init_fn, params),
    )
    with cost._patched(patch or None):
      programs[name] = step_fn.lower(grads, state, params).compile().as_text()
  psum_fn, floor_fn, _ = cost._baselines(mesh, n, int(density * num_elements))
  programs["dense_psum"] = psum_fn.lower(grads).compile().as_text()
  programs["floor"] = floor_fn.lower(grads, grads).compile().as_text()
  vector = 4 * num_elements
  out = {}
  for name, text in programs.items():
    traffic = hlo_memory.memory_traffic(text, vector // (2 * n))
    out[name] = {
      "vectors": traffic["bytes"] / vector,
      "ops": [
        {"vectors": b / vector, "opcode": op, "op_name": where, "computation": comp}
        for b, op, where, comp in traffic["ops"][:25]
      ],
    }
    _common.log(f"[profile] {name}: {out[name]['vectors']:.1f} x 4N bytes")
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--out", default=str(_common.RESULTS / "profile.json"))
  args = parser.parse_args()
  num_elements = 1_000_000 if args.quick else _common.RESNET18
  n, density = 8, 0.001
  clock = _common.Clock()
  static = static_profile(num_elements, n, density)
  config = {
    "elements": num_elements,
    "workers": n,
    "density": density,
    "methods": [
      "exdyna",
      "exdyna:controller=reference",
      "exdyna:capacity_factor=1.0",
      "micro",
      "dense",
      "dense:patch=no_guard",
      "topk_ef",
      "topk:patch=kth_min",
    ],
  }
  timing = cost.measure(config, repeats=3 if args.quick else 5, warmup=3)
  _common.log(
    f"[profile {clock():.0f}s] "
    + ", ".join(f"{k}={v * 1e3:.0f}ms" for k, v in timing["median_seconds"].items())
  )
  _common.write_json(
    args.out,
    {
      "benchmark": "profile",
      "elements": num_elements,
      "workers": n,
      "density": density,
      "static": static,
      "timing": timing,
      "total_seconds": clock(),
    },
  )


if __name__ == "__main__":
  sys.exit(main())
