"""XLA:CPU's slow fused concatenation of a gradient tree, shown without the library.

Run (4 CPU devices in one process; prefix ``taskset -c 0`` for one core)::

  python -m benchmarks.xla_cpu_concat [--repeats 30]

Why forming ``a = g + m`` is the largest part of ExDyna's own work on the
emulated cluster (`benchmarks/results/NOTES.md`, 'Where ExDyna's own work
goes on XLA:CPU'). Each variant is the error-feedback shell's accumulation,
``where(skip, m, flatten(g) + m)``, written into the donated ``[1, N]``
residual on every device, for a gradient tree shaped like the cluster
benchmark's MLP (256-2048-2048-10, 6 leaves, N = 4.7M). The median ms of
each:

* ``layout_order``: the leaves concatenated in their tree order, as the
  library does (the 4M weight is the fourth operand);
* ``big_leaf_first``: the same leaves with the 4M weight first;
* ``two_leaves``: the two weights only; ``one_leaf``: one leaf of ``N``;
* ``rows``: ``[1, size]`` rows concatenated along their minor axis, which
  XLA:CPU leaves unfused (a copy, then the add);
* ``plain_pass``: ``m * 0.5 + 1``, a pass over the residual alone.

On the 2 cores XLA:CPU splits each device's fusion over two threads, and
split, the fused ``concatenate`` runs about 3x slower than on one thread,
the more so the later the operand an element falls in; under ``taskset -c
0`` the layout order costs what one leaf does (2026-11-26: 11.8 against 3.0
ms on two cores, 3.8 against 3.8 ms on one; NOTES).
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


def variants():
  """``{name: (leaf shapes, accumulate(m [1, N], leaves, skip) -> [1, N])}``."""
  import jax.numpy as jnp

  def flat_row(leaves):
    return jnp.concatenate([leaf.reshape(-1) for leaf in leaves])[None]

  def accumulate(m, leaves, skip):
    return jnp.where(skip > 0, m, flat_row(leaves) + m)

  def rows(m, leaves, skip):
    row = jnp.concatenate([leaf.reshape(1, -1) for leaf in leaves], axis=1)
    return jnp.where(skip > 0, m, row + m)

  shapes = mlp_leaf_shapes()
  big = max(shapes, key=math.prod)
  num_elements = sum(map(math.prod, shapes))
  return {
      "layout_order": (shapes, accumulate),
      "big_leaf_first": ([big] + [s for s in shapes if s != big], accumulate),
      "two_leaves": ([s for s in shapes if len(s) == 2 and s[1] == 2048], accumulate),
      "one_leaf": ([(num_elements,)], accumulate),
      "rows": (shapes, rows),
      "plain_pass": (shapes, lambda m, leaves, skip: m * 0.5 + 1.0),
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
    print(f"{name:16s} {result[name]:7.2f} ms", flush=True)
  return result


if __name__ == "__main__":
  main()
