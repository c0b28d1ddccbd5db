"""The guard every update runs through: non-finite gradients and a resized state.

If the gradient ``g`` of *any* worker holds a NaN or an infinity, *every*
worker skips the step: the update is zero and the residual, threshold,
partitions and step counter keep their previous values; ``stats.nonfinite``
counts the bad elements over all workers and ``stats.skipped_steps`` the
skipped steps. One ``psum`` decides it (`screen`), so all workers decide
alike and the collectives stay matched (a per-worker decision, as
``optax.apply_if_finite`` makes, would desynchronise them). The step itself
always runs (on the residual alone when the gradient is bad: the shell
forms ``a = m``) and a skipped step's results are dropped by a select, so
no conditional waits on the bad-element count before the step: a GPU reads
a conditional's predicate back to the host before it launches the branch.
A state that does not fit stops the step with an error on the host before
the step runs: its recorded worker count is not the axis size (a restore
cut or padded its worker axis to fit), or it records the layout of another
gradient tree (leaves renamed or reordered since a checkpoint). That check
is one conditional, on the flag the screen's ``psum`` carries beside the
bad-element count.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from exdyna_jax.core import _collectives, _layout, _stats

COUNT_CHUNK = 1 << 16  # elements per iteration when non-finite elements are counted
SKIPPED_STEP_SCOPE = "skipped_step"  # names, in the HLO, what only a skipped step runs


class Screen(NamedTuple):
  """What the guard decides a step on; the same on every worker (``checked``
  in value: its type is each worker's own).

  Attributes:
    nonfinite: int32 NaN and infinite gradient elements over all workers.
    misfit: bool, whether any worker's state records another worker count
      or another layout.
    layout: int32 the values' `_layout.fingerprint` (0: not checked).
    bytes_sent: int32 what the screen sent (its ``psum``; a CPU's count of
      a bad step's elements too).
    checked: int32 0, `stop_if_misfit`'s, this worker's own: what adds it
      waits on the check. Kept apart from ``nonfinite``, which decides the
      update, so that the update stays the same on every worker (and typed
      so under ``shard_map``).
  """

  nonfinite: jax.Array
  misfit: jax.Array
  layout: jax.Array
  bytes_sent: jax.Array
  checked: jax.Array


def screen(values: Any, stats: _stats.SparsifierStats, num_workers: int, axis_name: str, *,
           layout: int = 0, leaves: str = "") -> Screen:
  """Counts every worker's NaN and infinite ``values``; stops a state that does not fit.

  One read-only pass and one ``psum`` of two int32 words tell every worker
  the same answer. On a GPU the pass counts the bad elements
  (`_count_by_count`); on a CPU, where a count takes several times longer
  than a sum, it sums the values and counts only where some worker's sum is
  not finite (`_count_by_sum`). Where some worker's state does not fit,
  `stop_if_misfit` raises on the host, before the step.

  Args:
    values: this worker's array, or pytree of arrays.
    stats: this worker's state's stats (the worker count and layout it
      records).
    num_workers: ``n``, the axis size.
    axis_name: the data-parallel axis.
    layout: the `_layout.fingerprint` of ``values`` where the state holds a
      residual laid out like them (a state that records another misfits);
      0 (default) checks nothing.
    leaves: the leaves of ``values`` (`_layout.fingerprint`), for the
      message of a state laid out for another tree.

  Returns:
    The `Screen`.
  """
  other_layout = (layout != 0) & (stats.layout != 0) & (stats.layout != layout)
  misfit = ((stats.num_workers != num_workers) | other_layout).astype(jnp.int32)
  nonfinite, misfits, sent = jax.lax.platform_dependent(
      values, misfit, cpu=functools.partial(_count_by_sum, axis_name=axis_name),
      default=functools.partial(_count_by_count, axis_name=axis_name))
  stopped = stop_if_misfit(misfits > 0, stats, layout, num_workers=num_workers,
                           axis_name=axis_name, leaves=leaves)
  flag_bytes = _collectives.ring_all_reduce_bytes(num_workers, 2 * _collectives.INDEX_BYTES)
  count_bytes = _collectives.ring_all_reduce_bytes(num_workers, _collectives.INDEX_BYTES)
  return Screen(nonfinite, misfits > 0, jnp.int32(layout), flag_bytes + sent * count_bytes,
                stopped)


def _count_by_count(values: Any, misfit: jax.Array, *, axis_name: str
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """`screen`'s pass as a count: ``(nonfinite, misfits, 0)`` (no second ``psum``)."""
  local = sum((jnp.sum(~jnp.isfinite(leaf), dtype=jnp.int32) for leaf in jax.tree.leaves(values)),
              jnp.int32(0))
  nonfinite, misfits = jax.lax.psum(jnp.stack([local, misfit]), axis_name)
  return nonfinite, misfits, jnp.int32(0)


def _count_by_sum(values: Any, misfit: jax.Array, *, axis_name: str
                  ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """`screen`'s pass as a sum: ``(nonfinite, misfits, 1 where the count was sent)``.

  A NaN or an infinity makes the sum of the values non-finite (a plain sum:
  on CPU, ``sum(values * 0)``, which could not overflow, takes twice as
  long). Only where some worker's sum is not finite are the bad elements
  counted (`count_nonfinite`, in the name scope `SKIPPED_STEP_SCOPE`: a
  second ``psum``); where finite values overflowed the sum the count is 0
  and the step goes on. The predicate is the same on every worker, so under
  ``jax.vmap`` too the conditional stays one (a per-worker predicate would
  make it a select that counts on every step).
  """
  total = sum((jnp.sum(leaf, dtype=jnp.float32) for leaf in jax.tree.leaves(values)),
              jnp.float32(0))
  flags = jnp.stack([(~jnp.isfinite(total)).astype(jnp.int32), misfit])
  tripped, misfits = jax.lax.psum(flags, axis_name)

  def count():
    with jax.named_scope(SKIPPED_STEP_SCOPE):
      return count_nonfinite(values, axis_name)

  nonfinite = jax.lax.cond(tripped > 0, count, lambda: jnp.zeros((), jnp.int32))
  return nonfinite, misfits, (tripped > 0).astype(jnp.int32)


def count_nonfinite(values: Any, axis_name: str) -> jax.Array:
  """NaN and infinite elements of every worker's ``values``, summed over the workers.

  Args:
    values: this worker's array, or pytree of arrays.
    axis_name: the data-parallel axis.

  Returns:
    int32 scalar, identical on every worker (one ``psum``).
  """
  zero = _collectives.per_worker(jnp.zeros((), jnp.int32), axis_name)
  local = sum((_count_in_chunks(leaf, zero) for leaf in jax.tree.leaves(values)), zero)
  return jax.lax.psum(local, axis_name)


def _count_in_chunks(leaf: jax.Array, zero: jax.Array) -> jax.Array:
  """NaN and infinite elements of ``leaf``, read in chunks of `COUNT_CHUNK`.

  XLA:CPU writes the predicate of a whole-leaf count out before it sums it:
  a leaf-sized int32 buffer that every step would reserve for this rarely
  taken branch. A loop over chunks needs one chunk's.
  """
  if _layout.is_sharded(leaf):  # typed over an Explicit axis: no flat view; count the shard
    return zero + jnp.sum(~jnp.isfinite(leaf), dtype=jnp.int32)
  flat = leaf.reshape(-1)
  chunk = min(flat.shape[0], COUNT_CHUNK)
  if chunk == 0:  # an empty leaf
    return zero

  def count_chunk(index, total):
    start = jnp.minimum(index * chunk, flat.shape[0] - chunk)  # the last one shifts left
    fresh = start + jnp.arange(chunk) >= index * chunk  # and counts only what is new
    bad = fresh & ~jnp.isfinite(jax.lax.dynamic_slice(flat, (start,), (chunk,)))
    return total + jnp.sum(bad, dtype=jnp.int32)

  return jax.lax.fori_loop(0, -(-flat.shape[0] // chunk), count_chunk, zero)


def raise_if_state_does_not_fit(recorded_workers: np.ndarray, recorded_layout: np.ndarray,
                                layout: np.ndarray, *, num_workers: int, axis_name: str,
                                leaves: str) -> None:
  """Raises if a state records another worker count or tree layout (a host callback).

  A state whose worker axis a restore cut or padded to fit another number of
  workers has the right shapes (`_stats.check_num_workers` passes) but still records
  the number it was initialized for (padded workers record 0). A state
  restored for a tree whose leaves were renamed or reordered since has the
  right shapes too, but records another layout fingerprint.

  Args:
    recorded_workers: ``stats.num_workers`` of one or more workers.
    recorded_layout: ``stats.layout`` of one or more workers (0: none yet).
    num_workers: size of ``axis_name`` in the calling context.
    axis_name: the data-parallel axis, for the message.
    layout: the fingerprint of this step's gradient tree (0: not checked).
    leaves: its leaves, for the message.

  Raises:
    ValueError: if any recorded count differs from ``num_workers``, or any
      recorded layout from ``layout``.
  """
  recorded = {int(r) for r in np.ravel(recorded_workers)}
  if recorded != {num_workers}:
    initialized_for = " or ".join(map(str, sorted(recorded - {0}))) or "another number of"
    raise ValueError(
        f"The optimizer state was initialized for {initialized_for} workers but axis "
        f"{axis_name!r} has {num_workers}, and its arrays were cut or padded to "
        f"{num_workers} workers' shapes (restoring a checkpoint with orbax's strict=False "
        "does this): the residuals of the workers cut off are lost and the partitions no "
        "longer fit. Restore onto the stored shapes instead and pass the state through "
        "exdyna_jax.resize_workers(tx, state, params, num_workers), which keeps what the "
        "parameters are owed."
    )
  layout = int(np.ravel(layout)[0])
  if layout and {int(r) for r in np.ravel(recorded_layout)} - {0, layout}:
    raise ValueError(
        "The optimizer state's residual was laid out for another parameter tree: leaves "
        "were renamed, reordered, added or removed since it was made (a checkpoint "
        "restored for a changed model, or another tree passed to update()), and stepping "
        "it would add each leaf's residual to another leaf. This step's leaves, in the "
        f"flat order a state follows: {leaves}. Restore the state with the model it was "
        "saved with, or start a fresh one with tx.init(params)."
    )


def skip_if_nonfinite(
    screened: Screen,
    step: Callable[..., tuple[Any, Any]],
    args: tuple[Any, ...],
    state: Any,
    *,
    skipped: Callable[[Any], Any] | None = None,
) -> tuple[Any, Any]:
  """The non-finite policy, shared by every method: skip the step on all workers.

  ``step`` always runs, and where the `Screen` found a bad element (on any
  worker: it is the same on every one) its output and state are replaced by
  the ``skipped`` output and ``state``: selects on the small results, so a
  finite step waits on no conditional.

  Args:
    screened: the `screen` of this step's gradients and of the state.
    step: ``(*args) -> (output, new_state)``, the step proper; ``new_state``
      has the structure of ``state``.
    args: what ``step`` is called with (finite on a skipped step too).
    state: the method's state before the step (a ``NamedTuple`` with
      ``stats``): a skipped step leaves it as it is.
    skipped: maps the shapes of ``step``'s output (``jax.ShapeDtypeStruct``
      leaves) to the output of a skipped step; by default zeros.

  Returns:
    ``step(*args)`` when ``screened.nonfinite == 0``; otherwise the
    ``skipped`` output and ``state``. Either way the state's ``stats.step``
    counts the steps taken (the only place it is advanced),
    ``stats.nonfinite`` is set to ``screened.nonfinite`` (its ``checked`` 0
    added), ``stats.skipped_steps`` counts the skipped steps,
    ``stats.bytes_sent`` is what the step and the screen sent (a skipped
    step's exchange runs too), and the running totals add this step's
    figures (a skipped step's bytes only); ``stats.layout`` records
    ``screened.layout``.
  """
  if skipped is None:
    skipped = functools.partial(jax.tree.map, lambda s: jnp.zeros(s.shape, s.dtype))
  output, ran = step(*args)
  drop = (screened.nonfinite > 0) | screened.misfit
  shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), output)
  output = jax.tree.map(lambda none, x: jnp.where(drop, none, x), skipped(shapes), output)
  new_state = jax.tree.map(lambda old, new: jnp.where(drop, old, new), state, ran)
  return output, new_state._replace(
      stats=guarded_stats(new_state.stats, ran.stats, state.stats, screened, drop))


def stop_if_misfit(misfit: jax.Array, stats: _stats.SparsifierStats, layout: int, *,
                   num_workers: int, axis_name: str, leaves: str) -> jax.Array:
  """`raise_if_state_does_not_fit` on the host where ``misfit``; int32 0 otherwise.

  The caller adds the 0 into the pass the step starts with (and into the
  stats), which keeps the check in the program (XLA drops a result nothing
  uses) and stops a state that does not fit before the step runs on it.

  Args:
    misfit: bool, the same on every worker: whether some worker's ``stats``
      record another worker count or layout.
    stats: this worker's state's stats.
    layout: this step's `_layout.fingerprint` (0: not checked).
    num_workers: ``n``, to name in the message.
    axis_name: the data-parallel axis, for the message.
    leaves: the gradient tree's leaves, for the message.

  Returns:
    int32 0 (the callback's, where it ran and did not raise).
  """
  stop = functools.partial(raise_if_state_does_not_fit, num_workers=num_workers,
                           axis_name=axis_name, leaves=leaves)
  return _collectives.on_host_if(misfit, stop, stats.num_workers, stats.layout,
                                 jnp.int32(layout))


def guarded_stats(stats: _stats.SparsifierStats, ran: _stats.SparsifierStats,
                  previous_stats: _stats.SparsifierStats, screened: Screen,
                  dropped: jax.Array) -> _stats.SparsifierStats:
  """The step's ``stats`` with the guard's fields: the step count, the bad elements, the bytes.

  ``ran`` is what the step reported before a skipped step's fields were
  dropped: its bytes were sent either way.
  """
  done = ~dropped
  return stats._replace(
      step=previous_stats.step + done.astype(jnp.int32),  # the one place steps are counted
      nonfinite=screened.nonfinite + screened.checked,
      skipped_steps=previous_stats.skipped_steps + (screened.nonfinite > 0).astype(jnp.int32),
      bytes_sent=_stats.add_bytes(ran.bytes_sent, screened.bytes_sent),
      num_workers=previous_stats.num_workers,
      layout=screened.layout,
      transmitted_total=_stats.add_to_total(
          previous_stats.transmitted_total, done * ran.transmitted),
      overflow_total=_stats.add_to_total(previous_stats.overflow_total, done * ran.overflow),
      bytes_total=_stats.add_to_total(ran.bytes_total, screened.bytes_sent),
      target_total=_stats.add_to_total(previous_stats.target_total, done * ran.target),
  )
