"""Hard-threshold sparsification with error feedback and an index-union exchange."""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

from exdyna_jax.core import _collectives, _options, _stats
from exdyna_jax.exchange import _exchange
from exdyna_jax.selection import _selection, _threshold
from exdyna_jax.shell import _density_schedule, _feedback

DEFAULT_CAPACITY_PER_K = 2.0


def hard_threshold(
    density: float | Mapping[int, float] | None = None,
    *,
    threshold: float | None = None,
    axis_name: str = "data",
    capacity_per_k: float = DEFAULT_CAPACITY_PER_K,
    capacity: int | None = None,
    value_dtype: Any = jnp.float32,
) -> optax.GradientTransformationExtraArgs:
  """Fixed-threshold sparsification with error feedback, as an optax transform.

  Every worker selects ``|a| >= threshold`` over its whole accumulated
  gradient; the workers all-gather their index buffers and sum their values
  at all of them, so the update is the mean of all workers' accumulated
  gradients on the union of their choices. Nothing ties the density to a
  target: it is whatever the gradients give, and the union grows as workers
  disagree (gradient build-up). The stats report ``selected`` = the sum of
  the workers' counts before the capacity limit, ``transmitted`` = the
  distinct indices in the union, ``overflow`` = elements that passed but did
  not fit a worker's buffer (they stay in its residual), and the per-worker
  counts as ``workloads``.

  The threshold is set by exactly one of ``density`` (the rule of Sahu et
  al., ``1 / (2 sqrt(k))`` with ``k = floor(density * N)``) and
  ``threshold``. Each worker's buffer holds ``capacity`` indices (the lowest
  ones that pass); by default ``ceil(capacity_per_k * k)``, i.e. room for
  twice the target ``k`` per worker, because nothing regulates the count.
  (Each worker here selects over all ``N`` elements, so its buffer is sized
  from ``k``; `exdyna`'s ``capacity_factor`` is a multiple of ``k / n``.)
  With ``threshold=`` there is no ``k``, so ``capacity`` must be given.

  Calling convention: :doc:`/usage`; non-finite gradients: :doc:`/bad_inputs`.

  Args:
    density: fraction ``d`` setting the threshold ``1 / (2 sqrt(d N))`` and
      the default capacity (1.0: the dense mean, one all-reduce), or a
      schedule ``{first_step: density}`` (:doc:`/usage`).
    threshold: a fixed threshold instead of ``density``.
    axis_name: name of the data-parallel axis.
    capacity_per_k: default buffer size as a multiple of ``k`` (with
      ``density``).
    capacity: index slots per worker; overrides ``capacity_per_k``, and is
      required with ``threshold``.
    value_dtype: float32 (default), bfloat16 or float16: what the exchanged
      values are summed in (:doc:`/usage`).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is an
    `ErrorFeedbackState`.

  Raises:
    ValueError: if both or neither of ``density`` and ``threshold`` are
      given, if ``threshold`` is given without ``capacity``, or an option is
      out of range.

  References:
    Sahu et al., "Rethinking gradient sparsification as total error
    minimization", NeurIPS 2021.

  Example:
    Four workers simulated with ``jax.vmap``; worker ``w`` has one large
    element, at index ``w``:

    >>> import jax, jax.numpy as jnp, exdyna_jax
    >>> tx = exdyna_jax.hard_threshold(threshold=0.5, capacity=4)
    >>> params = jnp.zeros(8)
    >>> grads = jnp.full((4, 8), 0.1).at[jnp.arange(4), jnp.arange(4)].set(1.0)
    >>> def step(g):  # runs per worker
    ...   updates, state = tx.update(g, tx.init(params), params)
    ...   return updates, exdyna_jax.get_stats(state)
    >>> updates, stats = jax.jit(jax.vmap(step, axis_name="data", axis_size=4))(grads)
    >>> print(stats.workloads[0])  # each worker selected one element
    [1 1 1 1]
    >>> print(jnp.flatnonzero(updates[0]))  # the union of the choices
    [0 1 2 3]
    >>> round(float(updates[0, 0]), 4)  # mean of 1.0, 0.1, 0.1 and 0.1
    0.325
  """
  density, threshold, capacity_per_k, capacity = check_options(
      density, threshold, capacity_per_k, capacity)
  exchange_above = functools.partial(
      threshold_step, axis_name=axis_name, value_dtype=_options.check_value_dtype(value_dtype))
  if density is None:
    return _feedback.error_feedback_transform(
        axis_name=axis_name,
        init_state=lambda residual, num_elements, num_workers: _feedback.ErrorFeedbackState(
            residual, _feedback.unpartitioned_initial_stats(threshold, num_elements, num_workers)),
        step=_feedback.stats_step(functools.partial(
            exchange_above, threshold=threshold, capacity=capacity, target=0)),
    )

  def sparsify(accumulated, stats, num_workers, k):
    return exchange_above(
        accumulated, stats, num_workers, threshold=_threshold.hard_threshold_rule(k),
        capacity=capacity or math.ceil(capacity_per_k * k), target=k)

  return _feedback.fixed_budget_transform(
      density, axis_name=axis_name, sparsify=sparsify,
      initial_threshold=_threshold.hard_threshold_rule,
  )


def threshold_step(accumulated: jax.Array, stats: _stats.SparsifierStats, num_workers: int, *,
                   threshold: float | jax.Array, capacity: int, target: int, axis_name: str,
                   value_dtype: Any) -> tuple[_exchange.SparseUpdate, _stats.SparsifierStats]:
  """Every worker's ``|a| >= threshold`` (its ``capacity`` lowest indices), summed at their union.

  ``threshold`` may differ between workers (`topk`'s steered one); the
  stats report the smallest, which rides the index all-gather. ``target``
  is the step's ``k`` (0 with a fixed threshold); the capacity is clipped to
  ``[1, N]``.
  """
  num_elements = accumulated.shape[0]
  slots = max(1, min(capacity, num_elements))
  chunk = _selection.chunk_length(num_elements, 1)
  threshold = jnp.asarray(threshold, jnp.float32)
  selection = _selection.select_in_range(
      accumulated,
      threshold,
      jnp.int32(0),
      jnp.int32(num_elements),
      capacity=slots,
      chunk=chunk,
      unrolled=_selection.unrolled_chunks(num_elements, 1, chunk),  # every chunk
  )
  exchanged = _exchange.exchange(
      accumulated, selection.indices,
      jnp.stack([selection.passed, _collectives.float_bits(threshold)]), axis_name,
      value_dtype=value_dtype,
  )
  passed = exchanged.gathered_info[:, 0]
  new_stats = _stats.unpartitioned_stats(
      stats,
      threshold=_collectives.bits_float(jnp.min(exchanged.gathered_info[:, 1])),
      selected=jnp.sum(passed),
      transmitted=_exchange.distinct_count(exchanged.gathered_indices, num_elements),
      overflow=jnp.sum(jnp.maximum(passed - slots, 0)),
      workloads=passed,
      num_elements=num_elements,
      bytes_sent=exchanged.bytes_sent,
      target=target,
  )
  return exchanged.sparse, new_stats


def check_options(density: Any, threshold: float | None, capacity_per_k: float,
                  capacity: int | None) -> tuple[Any, float | None, float, int | None]:
  """``(density, threshold, capacity_per_k, capacity)`` checked: exactly one of the first two.

  Raises:
    ValueError: for both or neither of ``density`` and ``threshold``, a
      fixed ``threshold`` without ``capacity``, or any option out of range.
  """
  if (density is None) == (threshold is None):
    raise ValueError(
        "hard_threshold needs exactly one of density= (threshold "
        "1 / (2 sqrt(floor(density * N)))) and threshold= (a fixed value), got "
        f"density={density!r}, threshold={threshold!r}."
    )
  if density is not None:
    _density_schedule.density_levels(density)  # checks a density or a schedule
    capacity_per_k = _options.check_positive_finite(
        capacity_per_k, "capacity_per_k", "index slots per worker as a multiple of k")
  else:
    threshold = _options.check_threshold(threshold)
    if capacity is None:
      raise ValueError(
          "hard_threshold(threshold=...) cannot size its index buffers from a "
          "density: pass capacity= (index slots per worker, e.g. twice the number "
          "of elements you expect above the threshold), or use density= instead."
      )
  if capacity is not None:
    capacity = _options.check_capacity(capacity)
  return density, threshold, capacity_per_k, capacity
