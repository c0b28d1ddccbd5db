"""The optax shell every error-feedback sparsifier shares.

ExDyna, MiCRO, Top-k, hard threshold and CLT-k differ only in how one step
turns this worker's accumulated gradient ``a = g + m`` into the aggregated
update, its new residual and the step's statistics. The shell does the rest:
it checks the gradient tree, flattens it, adds the residual, guards against
non-finite gradients, and unflattens the update.

Non-finite policy (every registered method, SparDL and dense included, through
`count_nonfinite` and `skip_if_nonfinite`): if the accumulated gradient
``g + m`` of *any* worker holds a NaN or an infinity, *every* worker skips the
step. The update is zero, and the residual, threshold, partitions, workloads
and step counter keep their previous values, so the bad values never enter
the state; ``stats.nonfinite`` counts the bad elements over all workers and
``stats.skipped_steps`` the skipped steps. The decision costs one int32
``psum`` per step, and all workers take it together: a per-worker decision
(as ``optax.apply_if_finite`` makes) would desynchronise the replicas.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from exdyna_jax import _exchange, _layout, _options, _stats


class ErrorFeedbackState(NamedTuple):
  """Optimizer state of an error-feedback sparsifier (per worker).

  Attributes:
    residual: float32 ``[N]`` error-feedback memory of this worker: what it
      accumulated and has not yet had transmitted.
    stats: `SparsifierStats` of the last step (for ExDyna also the
      partitions and workloads the next step rebalances from).
  """

  residual: jax.Array
  stats: _stats.SparsifierStats


# (accumulated [N], previous stats, n) -> (update [N], residual [N], stats)
SparsifyFn = Callable[
    [jax.Array, _stats.SparsifierStats, int],
    tuple[jax.Array, jax.Array, _stats.SparsifierStats],
]


def error_feedback_transform(
    *,
    axis_name: str,
    initial_stats: Callable[[int, int], _stats.SparsifierStats],
    sparsify: SparsifyFn,
) -> optax.GradientTransformationExtraArgs:
  """Builds an optax transform around one sparsification step.

  Args:
    axis_name: the data-parallel axis.
    initial_stats: ``(N, n) -> SparsifierStats`` before the first step (it
      also validates options that depend on ``N`` and ``n``).
    sparsify: ``(accumulated, stats, n) -> (update, residual, stats)``, run
      per worker inside the mapped context; ``stats`` are the previous
      step's.

  Returns:
    The optax transformation; its state is an `ErrorFeedbackState`.
  """

  def init_fn(params: Any) -> ErrorFeedbackState:
    layout = _layout.layout_of(params, what="params")
    num_workers = _exchange.axis_size(axis_name)
    residual = jnp.zeros((layout.num_elements,), _layout.ACCUMULATION_DTYPE)
    return ErrorFeedbackState(
        residual=_exchange.per_worker(residual, axis_name),
        stats=initial_stats(layout.num_elements, num_workers),
    )

  def update_fn(updates, state, params=None, **extra_args):
    del extra_args
    layout, num_workers = check_update(updates, state, params, axis_name)
    accumulated = _layout.flatten(updates) + state.residual
    nonfinite = count_nonfinite(accumulated, axis_name)

    def step():
      update, residual, stats = sparsify(accumulated, state.stats, num_workers)
      return update, ErrorFeedbackState(residual, stats)

    update, new_state = skip_if_nonfinite(nonfinite, step, state, num_workers)
    return _layout.unflatten(update, layout), new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def check_update(
    updates: Any, state: Any, params: Any, axis_name: str
) -> tuple[_layout.FlatLayout, int]:
  """The checks every method's ``update`` starts with.

  The gradient tree must match ``params`` and the state (its residual's
  length, when it has one), the state must belong to this number of workers,
  and the gradient must be local (not already summed over ``axis_name``).

  Args:
    updates: the gradient tree passed to ``update``.
    state: the method's state; it has a ``stats`` field, maybe a ``residual``.
    params: the params passed to ``update``, or None.
    axis_name: the data-parallel axis.

  Returns:
    ``(layout, n)``: the gradient's `FlatLayout` and the number of workers.
  """
  residual = getattr(state, "residual", None)
  layout = _layout.gradient_layout(
      updates, params, None if residual is None else residual.shape[0]
  )
  num_workers = _exchange.axis_size(axis_name)
  _stats.check_num_workers(state.stats, num_workers, axis_name)
  _exchange.check_local(updates, axis_name)
  return layout, num_workers


def count_nonfinite(values: Any, axis_name: str) -> jax.Array:
  """NaN and infinite elements of every worker's ``values``, summed over the workers.

  Args:
    values: this worker's array, or pytree of arrays.
    axis_name: the data-parallel axis.

  Returns:
    int32 scalar, identical on every worker (one ``psum``).
  """

  def count(leaf):
    # A NaN or infinity makes the sum non-finite: one read-only pass screens
    # the leaf, and the elements are counted only when the screen trips (or
    # when finite values overflowed the sum: then the count is 0).
    return jax.lax.cond(
        jnp.isfinite(jnp.sum(leaf, dtype=jnp.float32)),
        lambda: _exchange.per_worker(jnp.zeros((), jnp.int32), axis_name),
        lambda: jnp.sum(~jnp.isfinite(leaf), dtype=jnp.int32),
    )

  local = sum(count(leaf) for leaf in jax.tree.leaves(values))
  return jax.lax.psum(jnp.asarray(local, jnp.int32), axis_name)


def skip_if_nonfinite(
    nonfinite: jax.Array, step: Callable[[], tuple[Any, Any]], state: Any, num_workers: int
) -> tuple[Any, Any]:
  """The non-finite policy, shared by every method: skip the step on all workers.

  ``step`` runs inside a ``lax.cond``, so a finite step costs nothing extra
  (no select over the residual) and a skipped one does no work. ``nonfinite``
  is the same on every worker, so all of them take the same branch and the
  collectives inside ``step`` stay matched.

  Args:
    nonfinite: int32 `count_nonfinite` of this step's accumulated gradients.
    step: ``() -> (update, new_state)``, the step proper; the state has a
      ``stats`` field.
    state: the state before the step.
    num_workers: ``n``, to price the count's ``psum`` in ``stats.bytes_sent``.

  Returns:
    ``step()`` when ``nonfinite == 0``; otherwise a zero update and ``state``
    unchanged. Either way ``stats.nonfinite`` is set to ``nonfinite``,
    ``stats.skipped_steps`` counts the skipped steps, and
    ``stats.bytes_sent`` includes the count's ``psum`` (a skipped step sends
    nothing else).
  """
  skip = nonfinite > 0

  def skipped():
    update_shapes, _ = jax.eval_shape(step)
    zeros = jax.tree.map(lambda u: jnp.zeros(u.shape, u.dtype), update_shapes)
    silent = state.stats._replace(bytes_sent=jnp.zeros_like(state.stats.bytes_sent))
    return zeros, state._replace(stats=silent)

  update, kept = jax.lax.cond(skip, skipped, step)
  count_bytes = _exchange.ring_all_reduce_bytes(num_workers, _exchange.INDEX_BYTES)
  stats = kept.stats._replace(
      nonfinite=nonfinite,
      skipped_steps=state.stats.skipped_steps + skip.astype(jnp.int32),
      bytes_sent=kept.stats.bytes_sent + count_bytes,
  )
  return update, kept._replace(stats=stats)


# (accumulated [N], previous stats, n, k) -> (update [N], residual [N], stats)
BudgetSparsifyFn = Callable[
    [jax.Array, _stats.SparsifierStats, int, int],
    tuple[jax.Array, jax.Array, _stats.SparsifierStats],
]


def fixed_budget_transform(
    density: float, *, axis_name: str, sparsify: BudgetSparsifyFn
) -> optax.GradientTransformationExtraArgs:
  """An `error_feedback_transform` that picks ``k = floor(density * N)`` per step.

  For methods without a threshold (Top-k, CLT-k): the stats report a
  threshold of 0 before the first step.

  Args:
    density: fraction ``d`` of gradient elements, in ``(0, 1]``.
    axis_name: the data-parallel axis.
    sparsify: ``(accumulated, stats, n, k) -> (update, residual, stats)``.

  Returns:
    The optax transformation; its state is an `ErrorFeedbackState`.
  """
  density = _options.check_density(density)

  def initial_stats(num_elements: int, num_workers: int) -> _stats.SparsifierStats:
    _options.target_count(density, num_elements)  # rejects k = 0
    return unpartitioned_initial_stats(0.0, num_elements, num_workers)

  def sparsify_k(accumulated, stats, num_workers):
    k = _options.target_count(density, accumulated.shape[0])
    return sparsify(accumulated, stats, num_workers, k)

  return error_feedback_transform(
      axis_name=axis_name, initial_stats=initial_stats, sparsify=sparsify_k
  )


def unpartitioned_initial_stats(
    threshold: float, num_elements: int, num_workers: int
) -> _stats.SparsifierStats:
  """Statistics before the first step of a method where every worker scans all of ``N``."""
  return _stats.initial_stats(threshold, *_stats.whole_vector(num_workers, num_elements))
