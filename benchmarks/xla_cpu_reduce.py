"""XLA:CPU's slow in-process reduce of a flattened gradient, shown without the library.

Run (as root, several devices per process)::

  python -m exdyna_jax.launch --processes 2 --devices-per-process 2 \\
      python -m benchmarks.xla_cpu_reduce

Why `hierarchical(fast_reduce="scatter")` takes seconds a step on CPU worker
processes (`benchmarks/results/NOTES.md`, 'Hierarchical on the emulated
cluster'). On a ``("node", "local")`` mesh, one row per process, each
variant is a donated step of the cluster benchmark's MLP: the gradient, an
exchange over the in-process axis ``"local"``, SGD. Process 0 prints the
median ms of each:

* ``flat_scatter``: the leaves concatenated, ``psum_scatter`` over
  ``"local"``, ``all_gather`` back (what scatter mode does around the
  sparsifier);
* ``flat_scatter_constant``: the same with a constant gradient tree (no
  backward pass);
* ``tree_psum``: ``pmean`` of the gradient tree over ``"local"`` (psum mode);
* ``flat_gather``: the concatenated gradient's own slice, ``all_gather``-ed.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

# Importing the cluster worker joins the multi-process run (before any computation).
from benchmarks.cluster_worker import LOCAL, NODE, node_local_mesh
from exdyna_jax.demo import tasks

SIZES = (256, 2048, 2048, 10)


def exchange(variant: str, grads):
  """The variant's mean of ``grads`` over ``"local"`` (``flat_gather``: no mean)."""
  if variant == "tree_psum":
    return jax.tree.map(lambda g: jax.lax.pmean(g, LOCAL), grads)
  leaves, treedef = jax.tree.flatten(grads)
  num_local = jax.lax.axis_size(LOCAL)
  flat = jnp.concatenate([leaf.reshape(-1) for leaf in leaves])
  flat = jnp.pad(flat, (0, -flat.shape[0] % num_local))
  if variant == "flat_gather":
    size = flat.shape[0] // num_local
    part = jax.lax.dynamic_slice(flat, (jax.lax.axis_index(LOCAL) * size,), (size,))
  else:
    part = jax.lax.psum_scatter(flat, LOCAL, scatter_dimension=0, tiled=True) / num_local
  full = jax.lax.all_gather(part, LOCAL, tiled=True)
  starts = np.cumsum([0] + [leaf.size for leaf in leaves[:-1]])
  return treedef.unflatten([full[start:start + leaf.size].reshape(leaf.shape)
                            for start, leaf in zip(starts, leaves, strict=True)])


def median_ms(variant: str, mesh, params, batch, steps: int = 5) -> float:
  """Median ms of the variant's donated step, after one step off the clock."""
  def step(params, batch):
    if variant == "flat_scatter_constant":
      grads = jax.tree.map(lambda p: jnp.full_like(p, batch[0][0, 0]), params)
    else:
      grads = jax.grad(tasks.mlp_loss)(params, batch)
    updates = exchange(variant.removesuffix("_constant"), grads)
    return jax.tree.map(lambda p, u: p - 0.01 * u, params, updates)

  every = jax.P((NODE, LOCAL))
  train_step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(jax.P(), every),
                                     out_specs=jax.P(), check_vma=False), donate_argnums=0)
  params = jax.block_until_ready(train_step(jax.tree.map(jnp.copy, params), batch))
  multihost_utils.sync_global_devices(variant)
  seconds = []
  for _ in range(steps):
    start = time.perf_counter()
    params = jax.block_until_ready(train_step(params, batch))
    seconds.append(time.perf_counter() - start)
  return 1e3 * float(np.median(seconds))


def main() -> None:
  mesh = node_local_mesh()
  params = tasks.init_mlp(jax.random.key(0), SIZES)
  rng = np.random.default_rng(0)
  count = 32 * jax.local_device_count()  # this process's examples
  local = (rng.normal(size=(count, SIZES[0])).astype(np.float32),
           rng.integers(0, SIZES[-1], count).astype(np.int32))
  sharding = jax.sharding.NamedSharding(mesh, jax.P((NODE, LOCAL)))
  batch = tuple(jax.make_array_from_process_local_data(sharding, part) for part in local)
  for variant in ("flat_scatter", "flat_scatter_constant", "tree_psum", "flat_gather"):
    ms = median_ms(variant, mesh, params, batch)
    if jax.process_index() == 0:
      print(f"{variant}: {ms:.1f} ms a step", flush=True)


if __name__ == "__main__":
  main()
