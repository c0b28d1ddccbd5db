"""A model sharded over Explicit mesh axes: each device sparsifies the shards it holds.

Under `data_parallel` on a ``(data, model)`` mesh of Explicit axes
(``jax.make_mesh``'s default), a gradient leaf arrives typed over ``model``
(``f32[16,32@model]``). Rather than gather it, the shell runs the method in
a ``jax.shard_map`` manual over those axes: each device flattens its own
shards into its own vector, and the exchange runs over the data axis among
the devices that hold the same shards. A leaf replicated over some of the
axes (a bias) is cut into equal parts, one per device along them, so every
coordinate belongs to one vector; its update is all-gathered back over them
(a fast, in-host axis: these bytes are not in the stats).

The method's state gets a leading axis of one row per device along the
shard axes (its residual ``[shards, N / shards]``, split over them): no
device holds a full-size vector. Each row is the method's own state for its
shard, so each shard is sparsified at the density asked for, and the whole
model is too. The guard decides a step over every shard, so a bad value in
one skips all of them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import P

from exdyna_jax.core import _stats


def shard_axes() -> tuple[str, ...]:
  """The mesh axes the shell runs per shard over: Explicit ones of more than one device.

  Empty outside a mesh (``jax.vmap``, ``jax.pmap``) and where every axis is
  manual or Auto: there the method sees whole leaves, as before.
  """
  mesh = jax.sharding.get_abstract_mesh()
  return tuple(name for name, kind in zip(mesh.axis_names, mesh.axis_types, strict=True)
               if kind == jax.sharding.AxisType.Explicit and mesh.shape[name] > 1)


def with_shard_axes(axis_name: str | tuple[str, ...], axes: tuple[str, ...]
                    ) -> str | tuple[str, ...]:
  """The data axis (or axes) and the shard ``axes``: what the guard's screen sums over."""
  if not axes:
    return axis_name
  return (*((axis_name,) if isinstance(axis_name, str) else axis_name), *axes)


def spec_of(leaf: jax.Array) -> P:
  """The leaf's partition spec over the mesh's Explicit axes (from its type)."""
  return jax.typeof(leaf).sharding.spec


def axes_named(entry: Any) -> tuple[str, ...]:
  """The mesh axes a partition spec's entry names (None, one name, or a tuple of them)."""
  return (entry,) if isinstance(entry, str) else tuple(entry or ())


def replicated_over(leaf: jax.Array, axes: tuple[str, ...]) -> tuple[str, ...]:
  """The ``axes`` the leaf's spec does not name: every device along them holds all of it."""
  named = {name for entry in spec_of(leaf) for name in axes_named(entry)}
  return tuple(axis for axis in axes if axis not in named)


def own_part(shard: jax.Array, over: tuple[str, ...]) -> jax.Array:
  """This device's equal part of ``shard``, flat, where it is replicated ``over`` axes.

  The shard is padded with zeros to a multiple of the devices along them; a
  padding element's gradient is 0, so it is never selected at a density
  below 1 and its update is dropped by `whole`.
  """
  if not over:
    return shard
  parts = math.prod(jax.lax.axis_size(axis) for axis in over)
  flat = jnp.ravel(shard)
  size = -(-flat.shape[0] // parts)
  padded = jnp.pad(flat, (0, size * parts - flat.shape[0]))
  return jax.lax.dynamic_slice_in_dim(padded, jax.lax.axis_index(over) * size, size)


def whole(part: jax.Array, like: jax.Array, over: tuple[str, ...]) -> jax.Array:
  """The inverse of `own_part`: the parts all-gathered over ``over``, shaped like ``like``."""
  if not over:
    return part
  gathered = jax.lax.all_gather(part, over, tiled=True)
  return gathered[: like.size].reshape(like.shape)


def own_parts(tree: Any, over: Any) -> Any:
  """`own_part` of every leaf of a tree of shards, with its `replicated_over` axes in ``over``."""
  return jax.tree.map(own_part, tree, over)


def per_shard_init(init_fn: Callable[[Any], Any], params: Any, axes: tuple[str, ...]) -> Any:
  """``init_fn`` of each device's own parts, its state with a leading axis over ``axes``."""
  over = jax.tree.map(lambda leaf: replicated_over(leaf, axes), params)

  def body(params):
    return jax.tree.map(lambda x: x[None], init_fn(own_parts(params, over)))

  return jax.shard_map(body, in_specs=(jax.tree.map(spec_of, params),), out_specs=P(axes),
                       axis_names=frozenset(axes), check_vma=False)(params)


def per_shard_update(update_fn: Callable[..., tuple[Any, Any]], updates: Any, state: Any,
                     params: Any, axes: tuple[str, ...]) -> tuple[Any, Any]:
  """``update_fn`` on every device's own parts; the update made whole again.

  ``update_fn(parts, state, params, _shard_axes=axes)`` gets this device's
  parts of ``updates`` and ``params`` and its row of ``state``.

  Returns the whole update (`whole`: a collective over ``axes``), typed as
  ``updates`` are, and the new state with its leading axis over ``axes``.
  """
  over = jax.tree.map(lambda leaf: replicated_over(leaf, axes), updates)
  specs = jax.tree.map(spec_of, updates)
  param_specs = None if params is None else jax.tree.map(spec_of, params)

  def body(updates, state, params):
    own_params = None if params is None else own_parts(params, over)
    new, state = update_fn(own_parts(updates, over), jax.tree.map(lambda x: x[0], state),
                           own_params, _shard_axes=axes)
    return jax.tree.map(whole, new, updates, over), jax.tree.map(lambda x: x[None], state)

  return jax.shard_map(body, in_specs=(specs, P(axes), param_specs), out_specs=(specs, P(axes)),
                       axis_names=frozenset(axes), check_vma=False)(updates, state, params)


def summed_over_shards(stats: _stats.SparsifierStats) -> _stats.SparsifierStats:
  """One worker's stats of a model sharded over Explicit mesh axes, as the whole model's.

  Each device along those axes sparsifies its own shards (a leading axis of
  one row per shard). The last step's counts and the running totals are
  summed over the shards (``bytes_sent`` saturating as for one); the step
  counts, the non-finite count (the guard screens every shard) and the
  worker count are alike in every row and read once; the threshold,
  workloads, partitions and layout stay one row per shard.

  Args:
    stats: `SparsifierStats` with a leading shard axis and no worker axis.

  Returns:
    The stats as NumPy arrays.
  """
  stats = jax.device_get(stats)
  summed = lambda counts: np.sum(counts, axis=0, dtype=np.int64)  # noqa: E731

  def total(words):
    count = sum(int(high) * _stats.WORD + int(low) for high, low in np.reshape(words, (-1, 2)))
    return np.array(divmod(count, _stats.WORD), np.int32)

  return stats._replace(
      **{name: summed(getattr(stats, name)).astype(np.int32)
         for name in ("selected", "transmitted", "overflow", "target")},
      bytes_sent=np.minimum(summed(stats.bytes_sent), _stats.INT32_MAX).astype(np.int32),
      **{name: total(getattr(stats, name)) for name in _stats.TOTALS},
      **{name: np.asarray(getattr(stats, name))[0]
         for name in ("step", "nonfinite", "skipped_steps", "num_workers")},
  )
