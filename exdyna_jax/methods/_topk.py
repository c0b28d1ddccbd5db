"""Top-k sparsification with error feedback and an index-union exchange."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from exdyna_jax.core import _collectives, _layout, _options, _stats
from exdyna_jax.exchange import _exchange
from exdyna_jax.methods import _hard_threshold
from exdyna_jax.selection import _count_curve, _selection, _threshold
from exdyna_jax.shell import _density_schedule, _feedback


class SteeredTopKState(NamedTuple):
  """Optimizer state of ``topk(..., exact=False)`` (per worker).

  Attributes:
    residual: float32 ``[N]`` error-feedback memory of this worker.
    threshold: float32 this worker's own threshold at its last step (before
      the first: ``1 / (2 sqrt(k))``); it differs between workers.
    stats: `SparsifierStats` of the last step (``stats.threshold``: the
      smallest of the workers' thresholds).
    leaves_seen: `_layout.LeavesSeen`, static: which leaves of the params
      tree ``init`` saw.

  Example:
    Eight workers under ``jax.vmap``, each asked for ``k = 40`` of
    ``N = 4096``. The gradients are 12 times the initial threshold
    ``1 / (2 sqrt(40))``, so the first steps pass far more than ``k`` (only
    ``k`` are sent; the rest stay in the residual), and the threshold is
    found within a few steps:

    >>> import jax, jax.numpy as jnp, exdyna_jax
    >>> tx = exdyna_jax.topk(0.01, exact=False)
    >>> params = jnp.zeros(4096)
    >>> def run(grads):  # runs per worker: four steps
    ...   state, passed = tx.init(params), []
    ...   for g in grads:
    ...     state = tx.update(g, state, params)[1]
    ...     passed.append(state.stats.workloads)
    ...   return state, jnp.stack(passed)
    >>> grads = jax.random.normal(jax.random.key(0), (8, 4, 4096))
    >>> state, passed = jax.jit(jax.vmap(run, axis_name="data"))(grads)
    >>> type(state).__name__, state.threshold.shape  # a threshold each
    ('SteeredTopKState', (8,))
    >>> print(passed[0, 0, :4], passed[0, -1, :4])  # four workers' counts, first and last step
    [1485 1404 1586 1592] [40 40 38 41]
    >>> bool(jnp.all(jnp.abs(passed[0, -1] / 40 - 1) < 0.1))  # every worker within 10 %
    True
  """

  residual: jax.Array
  threshold: jax.Array
  stats: _stats.SparsifierStats
  leaves_seen: _layout.LeavesSeen | None = None


def topk(
    density: float | Mapping[int, float],
    *,
    axis_name: str = "data",
    value_dtype: Any = jnp.float32,
    exact: bool = True,
) -> optax.GradientTransformationExtraArgs:
  """Local top-k with error feedback, as an optax transform.

  Each worker picks the ``k = floor(density * N)`` largest magnitudes of its
  own accumulated gradient (``lax.top_k``, a sort-like pass over all ``N``
  elements; with ``exact=False``, what passes a threshold of its own, see
  below); the workers all-gather the ``[n, k]`` index lists and sum their
  values at all of them, so the update is the mean of all workers'
  accumulated gradients on the union of their choices. Workers disagree, so
  the union grows from ``k`` towards ``n k`` (gradient build-up): the stats
  report ``selected = n k`` and ``transmitted`` = the number of distinct
  indices in the union. Duplicates are harmless (every copy of an index
  carries the same sum) but still cost traffic: ``bytes_sent`` is that of
  ``n k`` slots.

  ``stats.threshold`` is the smallest of the workers' ``k``-th largest
  magnitudes (it rides on the index all-gather); ``stats.workloads`` is ``k``
  per worker.

  ``exact=False`` replaces the sort by two passes over ``N``, and no
  collective sets the threshold: each worker counts how many elements pass
  27 probe thresholds around its last threshold, interpolates the
  threshold its ``k``-th largest magnitude lies at (the count curve of
  `exdyna`'s adaptive controller, here on the worker's own vector), and
  sends the lowest ``k`` indices that pass it. The count is met to a few
  per cent once the threshold is found (a few steps from
  ``1 / (2 sqrt(k))``, see `SteeredTopKState`); what passes beyond ``k``
  stays in the residual (``stats.overflow``), and ``stats.workloads`` is
  each worker's count that passed. The buffers are those of the exact
  method (its side information one integer longer). The state is a
  `SteeredTopKState`.

  Calling convention: :doc:`/usage`; non-finite gradients: :doc:`/bad_inputs`.

  Args:
    density: fraction ``d`` of gradient elements each worker picks, in
      ``(0, 1]``, or a schedule ``{first_step: density}`` (`dgc_warmup`,
      :doc:`/usage`).
    axis_name: name of the data-parallel axis.
    value_dtype: float32 (default), bfloat16 or float16: what the values at
      the union of the workers' indices are summed in (:doc:`/usage`).
    exact: the exact ``k`` largest (a sort), or, with False, a steered
      threshold of each worker's own (two passes, no sort).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is an
    `ErrorFeedbackState` (``exact=False``: a `SteeredTopKState`).

  References:
    Aji & Heafield, "Sparse Communication for Distributed Gradient Descent",
    EMNLP 2017. Stich et al., "Sparsified SGD with Memory", NeurIPS 2018.

  Example:
    Eight workers, one per forced CPU device, under ``jax.shard_map``
    (``N = 4096``, ``k = 40``):

    >>> import jax, jax.numpy as jnp, exdyna_jax
    >>> from jax import P
    >>> n, k = 8, 40
    >>> mesh = jax.make_mesh((n,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    >>> tx = exdyna_jax.topk(density=0.01)
    >>> params = jnp.zeros(4096)
    >>> def step(grads):  # runs per device, on its own [1, N] slice
    ...   updates, state = tx.update(grads[0], tx.init(params), params)
    ...   return updates, exdyna_jax.get_stats(state)
    >>> step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("data"), out_specs=P(),
    ...                              check_vma=False))
    >>> grads = jax.random.normal(jax.random.key(0), (n, 4096))
    >>> updates, stats = step(grads)

    Each worker sends its own ``k``; they disagree, so the union is larger
    than ``k`` (gradient build-up):

    >>> int(stats.selected)
    320
    >>> bool(k < stats.transmitted <= n * k)
    True
    >>> int((updates != 0).sum()) == int(stats.transmitted)
    True
  """

  value_dtype = _options.check_value_dtype(value_dtype)
  if not isinstance(exact, bool):
    raise TypeError(f"exact must be True or False, got {exact!r}.")
  if not exact:
    return steered_topk(density, axis_name=axis_name, value_dtype=value_dtype)

  def sparsify(accumulated, stats, num_workers, k):
    num_elements = accumulated.shape[0]
    indices, kth = _selection.select_top_k(accumulated, k)
    exchanged = _exchange.exchange(
        accumulated, indices, _collectives.float_bits(kth)[None], axis_name,
        value_dtype=value_dtype,
    )
    selected = jnp.int32(num_workers * k)
    new_stats = _stats.unpartitioned_stats(
        stats,
        threshold=_collectives.bits_float(jnp.min(exchanged.gathered_info[:, 0])),
        selected=selected,
        transmitted=_exchange.distinct_count(exchanged.gathered_indices, num_elements),
        overflow=jnp.zeros((), jnp.int32),
        workloads=jnp.full((num_workers,), k, jnp.int32),
        num_elements=num_elements,
        bytes_sent=exchanged.bytes_sent,
        target=k,
    )
    return exchanged.sparse, new_stats

  return _feedback.fixed_budget_transform(density, axis_name=axis_name, sparsify=sparsify)


def steered_topk(density: float | Mapping[int, float], *, axis_name: str,
                 value_dtype: Any) -> _collectives.Sparsifier:
  """``topk(density, exact=False)``: each worker's own threshold, steered to its ``k``."""
  levels = _density_schedule.density_levels(density)

  def init_state(residual, num_elements, num_workers):
    threshold = _threshold.hard_threshold_rule(
        _density_schedule.initial_count(levels, num_elements))
    return SteeredTopKState(
        residual, _collectives.per_worker(jnp.float32(threshold), axis_name),
        _feedback.unpartitioned_initial_stats(threshold, num_elements, num_workers))

  def step_for(density):
    def step(accumulated, state, num_workers):
      k = _options.target_count(density, accumulated.shape[0])
      threshold = steered_threshold(accumulated, state.threshold, k)
      sparse, stats = _hard_threshold.threshold_step(
          accumulated, state.stats, num_workers, threshold=threshold, capacity=k, target=k,
          axis_name=axis_name, value_dtype=value_dtype)
      return sparse, state._replace(threshold=threshold, stats=stats)

    return step

  return _feedback.error_feedback_transform(
      axis_name=axis_name, init_state=init_state,
      step=_density_schedule.scheduled_step(levels, step_for, axis_name))


def steered_threshold(accumulated: jax.Array, previous: jax.Array, k: int) -> jax.Array:
  """The threshold ``k`` elements of ``|accumulated|`` pass, from one counting pass.

  The counts at `_threshold.probe_thresholds` around ``previous`` and the
  largest magnitude give the count curve; the threshold is where it meets
  ``k`` (`_count_curve.solve_count_curve`). With nothing to select (all
  zero) the previous threshold is kept.
  """
  num_elements = accumulated.shape[0]
  chunk = _selection.chunk_length(num_elements, 1)
  probes = _threshold.probe_thresholds(previous)
  counts, largest = _selection.count_in_range(
      accumulated, jnp.int32(0), jnp.int32(num_elements), probes, chunk=chunk,
      unrolled=_selection.unrolled_chunks(num_elements, 1, chunk))
  return jnp.where(largest > 0, _count_curve.solve_count_curve(probes, counts, k, largest),
                   previous)
