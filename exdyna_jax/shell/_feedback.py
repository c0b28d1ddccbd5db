"""The optax shell every error-feedback sparsifier shares.

ExDyna, MiCRO, Top-k, hard threshold, CLT-k and SparDL differ only in how
one step turns this worker's accumulated gradient ``a = g + m`` into the
aggregated update (a `_exchange.SparseUpdate`) and the method's new state.
The shell does the rest: it checks the gradient tree, flattens it, adds the
residual, guards against non-finite gradients, writes the update and the new
residual in place, keeps in the residual what rounding the update to a
narrow leaf dtype loses, and unflattens the update.

Non-finite gradients (every registered method, SparDL and dense included):
`_guard` skips the step on every worker together, so the bad values never
enter the state. The residual ``m`` is finite by construction (it only ever holds finite
accumulated values), so screening ``g`` screens ``g + m``, except for finite
values whose sum overflows float32 (``|g + m| > 3.4e38``), which is not
screened. Screening ``g`` before the sum is formed lets the sum be written in
place into the residual's buffer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from exdyna_jax.core import _collectives, _layout, _options, _stats
from exdyna_jax.exchange import _exchange
from exdyna_jax.shell import _density_schedule, _guard, _per_shard


class ErrorFeedbackState(NamedTuple):
  """Optimizer state of an error-feedback sparsifier (per worker).

  Attributes:
    residual: float32 ``[N]`` error-feedback memory of this worker: what it
      accumulated and has not yet had transmitted.
    stats: `SparsifierStats` of the last step.
    leaves_seen: `_layout.LeavesSeen`, static: which leaves of the params
      tree ``init`` saw (None in a state unpickled from before it).

  Example:
    >>> import jax, jax.numpy as jnp, exdyna_jax
    >>> tx = exdyna_jax.topk(density=0.01)
    >>> params = jnp.zeros(4096)
    >>> def step(g):  # runs per worker
    ...   return tx.update(g, tx.init(params), params)
    >>> grads = jax.random.normal(jax.random.key(0), (8, 4096))
    >>> updates, state = jax.jit(jax.vmap(step, axis_name="data", axis_size=8))(grads)
    >>> type(state).__name__, state.residual.shape  # [worker, N]: a residual each
    ('ErrorFeedbackState', (8, 4096))
    >>> kept_plus_sent = state.residual.sum(0) + 8 * updates[0]  # nothing is lost
    >>> bool(jnp.allclose(kept_plus_sent, grads.sum(0), atol=1e-5))
    True
  """

  residual: jax.Array
  stats: _stats.SparsifierStats
  leaves_seen: _layout.LeavesSeen | None = None


def error_feedback_transform(
    *,
    axis_name: str,
    init_state: Callable[[jax.Array, int, int], Any],
    step: _density_schedule.StepFn | _density_schedule.LevelSteps,
) -> _collectives.Sparsifier:
  """Builds an optax transform around one sparsification step.

  The method's state is any ``NamedTuple`` with a ``residual``, a ``stats``
  and a ``leaves_seen`` field (default None); the shell owns the residual
  (it forms ``a = g + m`` in the residual's own buffer and writes the new
  residual back) and ``leaves_seen`` (set by ``init``; the step sees None),
  the method everything else.

  Args:
    axis_name: the data-parallel axis.
    init_state: ``(residual, N, n) -> state`` before the first step, holding
      the given zero ``residual`` (it also validates options that depend on
      ``N`` and ``n``).
    step: ``(accumulated, state, n) -> (sparse_update, new_state)``, run per
      worker inside the mapped context on the previous ``state``. The shell
      writes the `SparseUpdate` into the dense update and its ``kept``
      values (zero by default) at its indices in the accumulated gradient to
      form the new residual. The step sees the state with ``residual`` and
      ``leaves_seen`` set to None and returns them so (a skipped step's
      branch returns the state it was given: the structures must agree).
      Or a density schedule's `_density_schedule.LevelSteps`: the current
      level's step runs, and its update is written, in one branch of a
      ``lax.switch``.

  Returns:
    The optax transformation.
  """

  def init_fn(params: Any) -> Any:
    axes = _per_shard.shard_axes()
    return _per_shard.per_shard_init(init_vector, params, axes) if axes else init_vector(params)

  def init_vector(params: Any) -> Any:
    layout = _layout.layout_of(params, what="params")
    num_workers = _collectives.axis_size(axis_name)
    residual = jnp.zeros((layout.num_elements,), _layout.ACCUMULATION_DTYPE)
    # Only N enters the state: the first update's gradient lays the residual out
    # (`SparsifierStats.layout`), and every later one must match it.
    state = init_state(
        _collectives.per_worker(residual, axis_name), layout.num_elements, num_workers
    )
    return state._replace(leaves_seen=_layout.leaves_seen(params))

  def update_fn(updates, state, params=None, _shard_axes=(), **extra_args):
    del extra_args
    if not _shard_axes and (axes := _per_shard.shard_axes()):  # each device its own shards
      return _per_shard.per_shard_update(update_fn, updates, state, params, axes)
    given, updates = updates, _layout.gathered(updates)
    layout, num_workers = check_update(updates, state, params, axis_name)
    # The step is traced in 32-bit mode whatever jax_enable_x64 says: its
    # counts, indices and loop carries are int32 and its state the one init()
    # made. Only the update is cast back to the leaves' dtypes (float64 too).
    with jax.enable_x64(False):
      fingerprint, leaves = _layout.fingerprint(updates)
      screened = _guard.screen(updates, state.stats, num_workers,
                               _per_shard.with_shard_axes(axis_name, _shard_axes),
                               layout=fingerprint, leaves=leaves)
      # [1, N], formed once the check of the state has passed (its 0 added)
      accumulated = accumulate(updates, state.residual, screened.nonfinite + screened.checked)
      # The method sees neither the residual nor leaves_seen: the shell owns both.
      previous = state._replace(residual=None, leaves_seen=None)

      def applied(step):  # one step: its update, the new residual, the state
        sparse, new_state = _guard.skip_if_nonfinite(
            screened, step, (accumulated[0], previous, num_workers), previous,
            skipped=lambda shapes: _exchange.SparseUpdate.nothing(
                shapes, layout.num_elements, axis_name))
        sparse = keep_what_rounding_loses(sparse, layout)
        return sparse.dense(layout.num_elements), cleared(sparse, accumulated)[0], new_state

      if isinstance(step, _density_schedule.LevelSteps):
        update, residual, new_state = _density_schedule.by_level(
            step, state.stats.step, applied, axis_name)
      else:
        update, residual, new_state = applied(step)
    new_state = new_state._replace(residual=residual, leaves_seen=state.leaves_seen)
    return _layout.resharded_like(_layout.unflatten(update, layout), given), new_state

  return _collectives.Sparsifier(init_fn, update_fn, axis_name)


def cleared(sparse: _exchange.SparseUpdate, accumulated: jax.Array) -> jax.Array:
  """``sparse.clear(accumulated)``, ordered after every read of ``accumulated``.

  The clear writes into ``a`` in place (the new residual takes the old
  one's buffer), so every read of ``a`` must come before it, the gather of
  the values at the indices too; nothing else orders that gather before the
  clear, and XLA copies ``a`` where it cannot prove the order. What the
  clear writes is made to depend on the values: ``min(|v|, 0)`` is 0 for
  every value but NaN, and XLA cannot fold it.
  """
  after_values = jnp.minimum(jnp.abs(sparse.values.astype(jnp.float32)), 0.0)
  kept = after_values if sparse.kept is None else sparse.kept + after_values
  return sparse._replace(kept=kept).clear(accumulated)


def keep_what_rounding_loses(
    sparse: _exchange.SparseUpdate, layout: _layout.FlatLayout
) -> _exchange.SparseUpdate:
  """Rounds the update to the leaves' dtypes and keeps the difference in the residual.

  A bfloat16 or float16 leaf cannot hold the float32 mean exactly, nor a
  float16 one a value past its range (clipped to 65,504). Each of the
  ``n`` workers keeps ``mean - rounded`` at that index, so the ``n`` residuals
  hold together what the rounded update of ``n`` workers' mass leaves out, and
  nothing is lost. Float32 (and wider) trees pay nothing: the check is static.
  """
  sent = _layout.as_leaf_dtypes(sparse.indices, sparse.values, layout)
  if sent is sparse.values:
    return sparse
  lost = sparse.values - sent
  kept = lost if sparse.kept is None else sparse.kept + lost
  return sparse._replace(values=sent, kept=kept)


def stats_step(
    sparsify: Callable[[jax.Array, _stats.SparsifierStats, int],
                       tuple[_exchange.SparseUpdate, _stats.SparsifierStats]],
) -> _density_schedule.StepFn:
  """The step of an `ErrorFeedbackState` method.

  Args:
    sparsify: ``(accumulated, previous stats, n) -> (sparse_update, stats)``.

  Returns:
    ``(accumulated, state, n) -> (sparse_update, new_state)``.
  """

  def step(accumulated, state, num_workers):
    sparse, stats = sparsify(accumulated, state.stats, num_workers)
    return sparse, state._replace(stats=stats)

  return step


def accumulate(updates: Any, residual: jax.Array, nonfinite: jax.Array) -> jax.Array:
  """``a = g + m`` in float32, or ``m`` itself when the step is skipped, as ``[1, N]``.

  The choice is made elementwise, in the pass that forms the sum, so ``a``
  can take the residual's buffer in place when the state is donated: a
  skipped step needs no copy of the old residual.

  The result keeps a leading axis of 1 until the residual is written back
  (index ``[0]`` to read it): under ``jax.pmap``, and under ``jax.shard_map``
  with a leading worker axis on the state, the residual's device buffer is
  ``[1, N]``, and XLA lets a result take an operand's buffer only when their
  shapes are equal; computed as ``[N]``, the new residual would be copied into
  the donated buffer every step (two passes over ``N``).

  How the leaves reach the flat vector depends on the platform (both ways
  give the same sum). A GPU runs one fused concatenation of the leaves at
  its memory bandwidth (`_concatenated_sum`). XLA:CPU emits that fusion
  slowly: each element walks the list of leaves, and split over threads the
  pass is slower still. There each leaf is added into its own slice of the
  residual instead (`_leaf_by_leaf_sum`), at the rate of one pass over a
  single leaf of ``N`` (`benchmarks/xla_cpu_concat.py` times both). On a GPU
  that would cost a kernel per leaf.

  Args:
    updates: this worker's gradient tree ``g``.
    residual: float32 ``[N]`` the residual ``m``.
    nonfinite: int32 `_guard.screen`'s count of this step's non-finite gradient elements.

  Returns:
    float32 ``[1, N]`` accumulated gradient.
  """
  return jax.lax.platform_dependent(
      updates, residual[None], nonfinite > 0, cpu=_leaf_by_leaf_sum, default=_concatenated_sum)


def _concatenated_sum(updates: Any, row: jax.Array, skip: jax.Array) -> jax.Array:
  """`accumulate` as one fusion: the leaves concatenated, then added to ``row``."""
  return jnp.where(skip, row, _layout.flatten(updates)[None] + row)


def _leaf_by_leaf_sum(updates: Any, row: jax.Array, skip: jax.Array) -> jax.Array:
  """`accumulate` as one in-place add per leaf into its slice of ``row``.

  Each leaf is a one-window ``scatter_add`` at its start, which XLA emits as
  an in-place update of that slice. The starts pass through an
  ``optimization_barrier``: a start XLA can fold to a constant makes it read
  the slice statically, and then copy all of ``row`` to update it. A skipped
  step adds zeros (``m + 0``: ``m``, up to the sign of a zero).
  """
  leaves = jax.tree.leaves(updates)
  starts = np.cumsum([0, *(leaf.size for leaf in leaves[:-1])])
  corners = jax.lax.optimization_barrier(  # [leaves, 2]: (0, start) of each slice of row
      jnp.asarray(np.stack([np.zeros_like(starts), starts], axis=1), jnp.int32))
  window = jax.lax.ScatterDimensionNumbers(
      update_window_dims=(0, 1), inserted_window_dims=(), scatter_dims_to_operand_dims=(0, 1))
  for leaf, corner in zip(leaves, corners, strict=True):
    values = jnp.where(skip, 0.0, jnp.reshape(leaf, (1, -1)).astype(_layout.ACCUMULATION_DTYPE))
    row = jax.lax.scatter_add(
        row, corner, values, window, indices_are_sorted=True, unique_indices=True,
        mode=jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS)
  return row


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
  if not _stats.is_sparsifier_state(state):
    raise TypeError(
        f"The sparsifier's state is a {type(state).__name__}, not the state its init returns "
        "(a checkpoint restored without a target comes back as plain dicts and lists): "
        "restore onto a target, e.g. orbax's args=ocp.args.StandardRestore(dp.init(params)) "
        "or flax.serialization.from_state_dict(dp.init(params), restored)."
    )
  residual = getattr(state, "residual", None)
  layout = _layout.gradient_layout(
      updates, params, None if residual is None else residual.shape[0]
  )
  num_workers = _collectives.axis_size(axis_name)
  _stats.check_num_workers(state.stats, num_workers, axis_name)
  _collectives.check_local(updates, axis_name)
  return layout, num_workers


# (accumulated [N], previous stats, n, k) -> (aggregated update, stats)
BudgetSparsifyFn = Callable[
    [jax.Array, _stats.SparsifierStats, int, int],
    tuple[_exchange.SparseUpdate, _stats.SparsifierStats],
]


def fixed_budget_transform(
    density: float | Mapping[int, float],
    *,
    axis_name: str,
    sparsify: BudgetSparsifyFn,
    initial_threshold: Callable[[int], float] = lambda k: 0.0,
    dense_at_one: bool = True,
) -> _collectives.Sparsifier:
  """An `error_feedback_transform` that picks ``k = floor(density * N)`` per step.

  For methods whose state is the residual and the stats (Top-k, CLT-k, hard
  threshold); schedules come with it.

  Args:
    density: fraction ``d`` of gradient elements, in ``(0, 1]``, or a
      schedule ``{first_step: density}`` (`_density_schedule`).
    axis_name: the data-parallel axis.
    sparsify: ``(accumulated, stats, n, k) -> (sparse_update, stats)``.
    initial_threshold: ``k -> `` the threshold the stats report before the
      first step (0 by default, for methods without one).
    dense_at_one: whether a lone ``density`` of 1.0 is the exact dense
      all-reduce (the default; a schedule's level of 1.0 always is), or
      ``sparsify`` with ``k = N`` (for a wire that rounds every value).

  Returns:
    The optax transformation; its state is an `ErrorFeedbackState`.
  """
  levels = _density_schedule.density_levels(density)

  def init_state(residual, num_elements, num_workers):
    k = _density_schedule.initial_count(levels, num_elements)  # rejects a level with k = 0
    return ErrorFeedbackState(
        residual, unpartitioned_initial_stats(initial_threshold(k), num_elements, num_workers)
    )

  def step_for(density):
    def sparsify_k(accumulated, stats, num_workers):
      k = _options.target_count(density, accumulated.shape[0])
      return sparsify(accumulated, stats, num_workers, k)

    return stats_step(sparsify_k)

  if len(levels) == 1 and not dense_at_one:  # a lone 1.0 too is sparsify's, k = N
    step = step_for(levels[0].density)
  else:
    step = _density_schedule.scheduled_step(levels, step_for, axis_name)
  return error_feedback_transform(axis_name=axis_name, init_state=init_state, step=step)


def unpartitioned_initial_stats(
    threshold: float, num_elements: int, num_workers: int
) -> _stats.SparsifierStats:
  """Statistics before the first step of a method where every worker scans all of ``N``."""
  return _stats.initial_stats(threshold, *_stats.whole_vector(num_workers, num_elements))
