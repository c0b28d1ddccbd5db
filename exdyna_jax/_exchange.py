"""The sparse exchange shared by every index-union sparsifier.

Each worker packs the indices it chose into a buffer of static capacity ``C``
(unused slots hold the sentinel ``N``, which every later step ignores). One
``all_gather`` moves the ``[n, C]`` index buffers, with any small integer side
information (counts, probe counts) appended to them; every worker reads its
own accumulated gradient at all gathered indices, the values are summed with
one ``psum``, and the mean is written with a scatter that drops the sentinel.
Every worker then clears its residual at every transmitted index.

Writing with *set* (not add) makes duplicate indices harmless: all copies of an
index carry the same summed value.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from exdyna_jax._partition import ROW

INDEX_BYTES = 4
VALUE_BYTES = 4


def axis_size(axis_name: str) -> int:
  """Number of workers on ``axis_name``, with an error that says how to bind it."""
  try:
    return jax.lax.axis_size(axis_name)
  except NameError:
    raise ValueError(
        f"Axis {axis_name!r} is not bound. A sparsifier's init() and update() run "
        "per worker: call them inside jax.shard_map (mesh axis "
        f"{axis_name!r}), jax.pmap(..., axis_name={axis_name!r}) or "
        f"jax.vmap(..., axis_name={axis_name!r}, axis_size=n); with plain jax.jit "
        "use exdyna_jax.data_parallel(). Or pass axis_name= to match your mesh."
    ) from None


def _is_manual(axis_name: str) -> bool:
  """True under shard_map or pmap, where collectives can return invariant values."""
  return axis_name in jax.sharding.get_abstract_mesh().manual_axes


def check_local(grads, axis_name: str) -> None:
  """Rejects gradients that are already reduced over ``axis_name``.

  Inside ``jax.shard_map(check_vma=True)``, ``jax.grad`` with respect to
  replicated parameters returns the gradient already ``psum``-med over the
  axis: sparsifying it would compress summed gradients after the dense traffic
  was paid. The varying-axes type tells them apart.
  """
  if not _is_manual(axis_name):
    return
  tracks_varying = axis_name in jax.typeof(jax.lax.axis_index(axis_name)).manual_axis_type.varying
  if not tracks_varying:
    return
  for path, leaf in jax.tree_util.tree_flatten_with_path(grads)[0]:
    if axis_name not in jax.typeof(leaf).manual_axis_type.varying:
      raise ValueError(
          f"Gradient leaf {jax.tree_util.keystr(path)} is invariant over {axis_name!r}: "
          "it was already summed across workers (jax.grad of replicated params "
          "inside shard_map all-reduces the gradient densely). Differentiate a "
          f"varying copy instead: jax.grad(loss)(jax.lax.pcast(params, {axis_name!r}, "
          "to='varying'), batch), and put the sparsifier first in the chain."
      )


def compact(mask: jax.Array, capacity: int) -> tuple[jax.Array, jax.Array]:
  """Indices of the first ``capacity`` set positions of ``mask``, in order.

  Two levels keep the prefix sums small: rows of 32 elements are counted, the
  first ``capacity`` non-empty rows found (a prefix sum over ``N / 32`` row
  flags), and only those ``capacity x 32`` elements compacted. The first
  ``capacity`` set positions always lie in the first ``capacity`` non-empty
  rows.

  Args:
    mask: bool ``[N]``.
    capacity: static number of slots ``C``.

  Returns:
    ``(indices, count)``: int32 ``[C]`` ascending indices, padded with the
    sentinel ``N``; and the int32 number of set positions (which may exceed
    ``C``).
  """
  num_elements = mask.shape[0]
  num_rows = -(-num_elements // ROW)
  rows = jnp.pad(mask, (0, num_rows * ROW - num_elements)).reshape(num_rows, ROW)
  row_counts = jnp.sum(rows, axis=1, dtype=jnp.int32)
  count = jnp.sum(row_counts)
  num_picked = min(capacity, num_rows)
  (row_ids,) = jnp.nonzero(row_counts > 0, size=num_picked, fill_value=num_rows)
  picked = rows.at[row_ids].get(mode="fill", fill_value=False)
  per_row = jnp.sum(picked, axis=1, dtype=jnp.int32)
  row_offsets = jnp.cumsum(per_row) - per_row
  rank_in_row = jnp.cumsum(picked, axis=1, dtype=jnp.int32) - 1
  slots = jnp.where(picked, row_offsets[:, None] + rank_in_row, capacity)
  element_ids = row_ids[:, None] * ROW + jnp.arange(ROW, dtype=jnp.int32)
  indices = jnp.full((capacity,), num_elements, jnp.int32)
  indices = indices.at[slots.reshape(-1)].set(element_ids.reshape(-1), mode="drop")
  return indices, count


class Selection(NamedTuple):
  """What one worker chose this step.

  Attributes:
    indices: int32 ``[C]`` chosen indices, sentinel ``N`` in unused slots.
    passed: int32 number of elements that passed the threshold (before
      capacity).
    sent: int32 ``|I_w|`` as the reference counts it: ``passed``, or 1 when
      the fallback index was sent.
    probe_counts: int32 ``[P]`` elements passing each probe threshold.
  """

  indices: jax.Array
  passed: jax.Array
  sent: jax.Array
  probe_counts: jax.Array


def select_window(
    accumulated: jax.Array,
    threshold: jax.Array,
    begin: jax.Array,
    end: jax.Array,
    *,
    capacity: int,
    probe_ratios: tuple[float, ...] = (),
    fallback_offset: jax.Array | None = None,
) -> Selection:
  """Selects ``|a| >= threshold`` inside ``[begin, end)``.

  Args:
    accumulated: float32 ``[N]`` accumulated gradient of this worker.
    threshold: float32 scalar.
    begin: int32 first index of the window.
    end: int32 one past the last index of the window.
    capacity: static buffer size ``C``.
    probe_ratios: static multipliers of ``threshold`` to count as well.
    fallback_offset: if given and nothing passes, index
      ``begin + fallback_offset mod (end - begin)`` is sent alone (so every
      worker always sends something, as the reference does).

  Returns:
    The `Selection`.
  """
  positions = jnp.arange(accumulated.shape[0], dtype=jnp.int32)
  in_window = (positions >= begin) & (positions < end)
  magnitude = jnp.abs(accumulated)
  mask = in_window & (magnitude >= threshold)
  indices, passed = compact(mask, capacity)
  probe_counts = jnp.stack(
      [jnp.sum(in_window & (magnitude >= threshold * ratio), dtype=jnp.int32) for ratio in probe_ratios]
  ) if probe_ratios else jnp.zeros((0,), jnp.int32)
  sent = passed
  if fallback_offset is not None:
    nothing = passed == 0
    fallback = begin + fallback_offset % (end - begin)
    indices = indices.at[0].set(jnp.where(nothing, fallback, indices[0]))
    sent = jnp.where(nothing, 1, passed)
  return Selection(indices, passed, sent, probe_counts)


class Exchanged(NamedTuple):
  """Result of the index-union exchange, per worker.

  Attributes:
    update: float32 ``[N]`` mean of all workers' accumulated gradients at the
      transmitted indices, zero elsewhere; identical on every worker.
    residual: float32 ``[N]`` this worker's accumulated gradient with every
      transmitted index cleared.
    gathered_indices: int32 ``[n, C]`` every worker's index buffer.
    gathered_info: int32 ``[n, S]`` every worker's side information.
  """

  update: jax.Array
  residual: jax.Array
  gathered_indices: jax.Array
  gathered_info: jax.Array


def exchange(
    accumulated: jax.Array, indices: jax.Array, side_info: jax.Array, axis_name: str
) -> Exchanged:
  """All-gathers index buffers (and side information), sums values, scatters.

  Args:
    accumulated: float32 ``[N]`` this worker's accumulated gradient.
    indices: int32 ``[C]`` this worker's chosen indices, sentinel ``N``.
    side_info: int32 ``[S]`` small per-worker integers every worker needs.
    axis_name: the data-parallel axis.

  Returns:
    The `Exchanged` result.
  """
  num_workers = axis_size(axis_name)
  capacity = indices.shape[0]
  payload = jnp.concatenate([indices, side_info.astype(jnp.int32)])
  if _is_manual(axis_name):
    gathered = jax.lax.all_gather(payload, axis_name, to="invarying")
  else:  # vmap(axis_name=...) has no invariant all_gather
    gathered = jax.lax.all_gather(payload, axis_name)
  gathered_indices = gathered[:, :capacity]
  flat_indices = gathered_indices.reshape(-1)
  values = accumulated.at[flat_indices].get(mode="fill", fill_value=0)
  mean = jax.lax.psum(values, axis_name) / num_workers
  update = jnp.zeros(accumulated.shape, accumulated.dtype).at[flat_indices].set(mean, mode="drop")
  residual = accumulated.at[flat_indices].set(0, mode="drop")
  return Exchanged(update, residual, gathered_indices, gathered[:, capacity:])


def exchange_bytes(num_workers: int, capacity: int, side_info: int) -> int:
  """Bytes one worker sends per step in `exchange`, for ring collectives.

  A ring all-gather of ``M`` bytes per worker sends ``(n-1) M``; a ring
  all-reduce of ``M`` bytes sends ``2 (n-1) / n M``. The values all-reduced are
  ``n C`` floats.
  """
  gather = (num_workers - 1) * (capacity + side_info) * INDEX_BYTES
  reduce = 2 * (num_workers - 1) * capacity * VALUE_BYTES
  return gather + reduce
