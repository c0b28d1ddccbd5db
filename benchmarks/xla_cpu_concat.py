"""XLA:CPU's slow fused concatenation of a gradient tree, and the library's way round it.

Run (4 CPU devices in one process; prefix ``taskset -c 0`` for one core)::

  python -m benchmarks.xla_cpu_concat [--repeats 30]

Why the error-feedback shell forms ``a = g + m`` leaf by leaf on CPU
(`exdyna_jax.shell._feedback.accumulate`; `benchmarks/results/NOTES.md`, 'Where
ExDyna's own work goes on XLA:CPU'). Each variant is that accumulation,
``where(skip, m, flatten(g) + m)``, written into the donated ``[1, N]``
residual on every device. The median ms of each, for a gradient tree shaped
like the cluster benchmark's MLP (256-2048-2048-10, 6 leaves, N = 4.7M):

* ``layout_order``: the leaves concatenated in their tree order, one fusion
  (what the library runs on GPUs: `exdyna_jax.shell._feedback._concatenated_sum`;
  the 4M weight is the fourth operand);
* ``leaf_by_leaf``: each leaf added into its slice of the residual in place
  (what the library runs on CPU: `exdyna_jax.shell._feedback._leaf_by_leaf_sum`);
* ``static_starts``: the same adds at starts XLA can fold to constants
  (``m.at[0, start:end].add``), which makes it copy the whole residual for
  the leaf at start 0;
* ``big_leaf_first``: the concatenation with the 4M weight first;
* ``two_leaves``: the two weights only; ``one_leaf``: one leaf of ``N``;
* ``rows``: ``[1, size]`` rows concatenated along their minor axis, which
  XLA:CPU leaves unfused (a copy, then the add);
* ``plain_pass``: ``m * 0.5 + 1``, a pass over the residual alone;

and ``layout_order`` and ``leaf_by_leaf`` again for a transformer-shaped
tree of 122 leaves (N = 54M, `transformer_leaf_shapes`).

In the fused concatenation each element walks the list of operands, and
XLA:CPU splits the fusion over its intra-op threads, which makes it slower
still. On the 2 cores, 2026-11-26: the MLP 11.7 ms fused against 3.9 leaf by
leaf (one leaf of N: 3.9; static starts 6.1), the transformer 237 against
44; under ``taskset -c 0`` the MLP 4.5 against 4.7 (unsplit, a few-leaf
concatenation runs at one leaf's rate) and the transformer 417 against 53
(NOTES).
"""

from __future__ import annotations

import argparse
import math
import time

from benchmarks import _common

DEVICES = 4
SIZES = (256, 2048, 2048, 10)


def mlp_leaf_shapes() -> list[tuple[int, ...]]:
  """The cluster benchmark's MLP's leaf shapes, in tree order."""
  import jax

  from exdyna_jax.demo import tasks

  tree = jax.eval_shape(lambda: tasks.init_mlp(jax.random.key(0), SIZES))
  return [leaf.shape for leaf in jax.tree.leaves(tree)]


def transformer_leaf_shapes() -> list[tuple[int, ...]]:
  """A 12-layer transformer's leaves (width 512, MLP 2048, 32k vocabulary): 122, N = 54M."""
  layer = [(512,), (512,), (512, 512), (512, 512), (512, 512), (512, 512), (512, 2048),
           (2048,), (2048, 512), (512,)]
  return [(32000, 512), *layer * 12, (512,)]


def variants():
  """``{name: (leaf shapes, accumulate(m [1, N], leaves, skip) -> [1, N])}``."""
  import jax.numpy as jnp

  from exdyna_jax.shell import _feedback

  def accumulate(m, leaves, skip):
    return _feedback._concatenated_sum(leaves, m, skip > 0)

  def leaf_by_leaf(m, leaves, skip):
    return _feedback._leaf_by_leaf_sum(leaves, m, skip > 0)

  def static_starts(m, leaves, skip):
    offset = 0
    for leaf in leaves:
      m = m.at[0, offset:offset + leaf.size].add(jnp.where(skip > 0, 0.0, leaf.reshape(-1)))
      offset += leaf.size
    return m

  def rows(m, leaves, skip):
    row = jnp.concatenate([leaf.reshape(1, -1) for leaf in leaves], axis=1)
    return jnp.where(skip > 0, m, row + m)

  shapes, transformer = mlp_leaf_shapes(), transformer_leaf_shapes()
  big = max(shapes, key=math.prod)
  num_elements = sum(map(math.prod, shapes))
  return {
      "layout_order": (shapes, accumulate),
      "leaf_by_leaf": (shapes, leaf_by_leaf),
      "static_starts": (shapes, static_starts),
      "big_leaf_first": ([big] + [s for s in shapes if s != big], accumulate),
      "two_leaves": ([s for s in shapes if len(s) == 2 and s[1] == 2048], accumulate),
      "one_leaf": ([(num_elements,)], accumulate),
      "rows": (shapes, rows),
      "plain_pass": (shapes, lambda m, leaves, skip: m * 0.5 + 1.0),
      "transformer_layout_order": (transformer, accumulate),
      "transformer_leaf_by_leaf": (transformer, leaf_by_leaf),
  }


def median_ms(shapes, accumulate, repeats: int) -> float:
  """Median ms of the donated accumulation on every device, after two runs off the clock."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  mesh = _common.mesh_of(DEVICES)
  sharding = jax.NamedSharding(mesh, jax.P(_common.AXIS))
  num_elements = sum(map(math.prod, shapes))

  def per_device(m, leaves, skip):
    return accumulate(m, [leaf[0] for leaf in leaves], skip[0])

  run = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=jax.P(_common.AXIS),
                              out_specs=jax.P(_common.AXIS)), donate_argnums=0)
  residual = jax.device_put(jnp.zeros((DEVICES, num_elements)), sharding)
  leaves = [jax.device_put(jnp.ones((DEVICES, *s)), sharding) for s in shapes]
  skip = jax.device_put(jnp.zeros((DEVICES,), jnp.int32), sharding)
  for _ in range(2):
    residual = jax.block_until_ready(run(residual, leaves, skip))
  seconds = []
  for _ in range(repeats):
    start = time.perf_counter()
    residual = jax.block_until_ready(run(residual, leaves, skip))
    seconds.append(time.perf_counter() - start)
  return 1e3 * float(np.median(seconds))


def main(argv=None) -> dict[str, float]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--repeats", type=int, default=30)
  args = parser.parse_args(argv)
  _common.force_devices(DEVICES)
  result = {}
  for name, (shapes, accumulate) in variants().items():
    result[name] = median_ms(shapes, accumulate, args.repeats)
    print(f"{name:26s} {result[name]:7.2f} ms", flush=True)
  return result


if __name__ == "__main__":
  main()
