"""Online control of the global selection threshold.

A controller picks, before selection, the one threshold every worker uses at
this step. Two are provided:

- ``"reference"`` is the published ExDyna/MiCRO rule, exactly: start at
  ``1 / (2 sqrt(k))`` and, from the second step on, scale by ``x1.005`` when
  the previous step's ``K/k > 1.1``, by ``x1.00125`` when
  ``0.909 < K/k <= 1.1`` (the released code's downward nudge inside that band
  can never trigger, so the threshold creeps up there) and by ``x0.995``
  otherwise. Threshold arithmetic is float32.
- ``"adaptive"`` (default) measures instead of guessing. Each worker counts,
  in one pass over its own partition, how many elements pass each of 27
  probe thresholds ``c * 2^x`` around the previous threshold ``c``, with
  ``x`` in ``0, +-1/512, +-1/256, +-1/128, +-1/64, +-1/32, +-3/64, +-1/16,
  +-3/32, +-1/8, +-3/16, +-1/4, +-1/2, +-1`` octaves
  (`ADAPTIVE_PROBE_OCTAVES`), and its largest ``|a|``; one ``all_gather`` of
  those 28 integers gives every worker every worker's count curve of *this*
  step's accumulated gradient. Capping each worker's count at its buffer
  gives the curve of indices that would be *transmitted* (not capped at the
  ``1.1 k`` value slots, which would flatten it just above ``k`` and pull
  the interpolated threshold too low), and the threshold is where it meets
  ``k``, interpolated linearly in log-log between the two points around
  ``k`` (`_count_curve.solve_count_curve`), but never so low that more
  elements pass than can be sent. Where that floor decides, because a burst
  filled some buffers, the threshold rises until the first full one comes
  down to its size (`_count_curve.relieve_full_buffers`). The largest
  magnitude is one more known point of the curve (one element passes it),
  so a jump of the gradient scale by any factor is found again in a few
  steps, and with nothing to select (``largest == 0``) the threshold keeps
  its value instead of collapsing.

The adaptive rule costs one extra collective per step (28 int32 per worker)
and one read of the worker's partition, in place and chunk by chunk
(`_selection.count_in_range`), with all 27 counts packed into one reduction.
The probes are dense next to ``c`` because error feedback piles magnitudes
up just below a slowly moving threshold: late in training the count curve
can halve within 1 % of ``c`` (log-log slopes of -50 were measured).
Probes evenly an eighth of an octave apart, with the segment slope clamped
to ``_count_curve.SLOPE_RANGE``, gave median errors 4x larger on the digits
MLP of ``benchmarks/density_control.py``; a predictive variant that reused the
previous step's counts (no extra round) held only a 20 % median error,
because error feedback makes the count at a fixed threshold swing with the
previous step's selection. The released ExDyna code also spends a separate
count all-gather per step, so the round count matches the reference
implementation's.

References:
  Yoon & Oh, ExDyna, CCGrid 2024, arXiv:2402.13781, section IV-C.
  Sahu et al., "Rethinking gradient sparsification as total error
  minimization", NeurIPS 2021 (the initial threshold).
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from exdyna_jax.core import _collectives, _integer
from exdyna_jax.selection import _count_curve, _selection

# Published rule: band edges as exact (numerator, denominator), and factors.
REFERENCE_UPPER = (11, 10)
REFERENCE_LOWER = (909, 1000)
REFERENCE_FACTORS = (1.005, 1.00125, 0.995)

# Probe offsets in octaves around the previous threshold: 1/512 of an octave
# (0.14 %) apart next to it, where the threshold usually moves and where error
# feedback piles magnitudes up (the count can halve within 1 %), wider out to
# one octave; the largest magnitude (`ProbeCounts.largest`) covers transients.
# The +-1/512 pair took the median error of the char transformer at d = 0.001 on
# 4 workers (k = 112) from 3.6 % to 2.7 %. The +-3/64, +-3/32 and +-3/16
# midpoints halve the segments a threshold moving 2-10 % in a step lands in:
# on the 1.1M MLP at d = 0.001 on 4 workers, the 90th / 99th percentile of
# selected / aimed fell from 1.19 / 1.46 to 1.09 / 1.17 and its overflow from
# 2.8 % of k to 0.1 %. The +-1/2 pair splits the widest segments, where a
# threshold lands when it falls 20-35 % in a step: there the count passing it
# ran 1.3-1.6x above the interpolated one, past the value slots (digits MLP on
# 4 workers, 4 seeds: overflow 0.61 % -> 0.31 % of k). 27 probes use six count
# words of five fields.
_NEAR = (1 / 512, 1 / 256, 1 / 128, 1 / 64, 1 / 32, 3 / 64, 1 / 16, 3 / 32, 1 / 8, 3 / 16,
         1 / 4, 1 / 2, 1)
ADAPTIVE_PROBE_OCTAVES = tuple(sorted((0.0, *_NEAR, *(-x for x in _NEAR))))
ADAPTIVE_PROBE_RATIOS = tuple(2.0**x for x in ADAPTIVE_PROBE_OCTAVES)
ADAPTIVE_RELIEF_LOSS = 0.1  # of k: what relieving full buffers may cost
CORRECTION_RATE = 0.3  # integral feedback on the target (`correct`)
CORRECTION_STEP = 0.1  # at most this far in log space per step
CORRECTION_RANGE = (0.5, 2.0)


class ProbeCounts(NamedTuple):
  """What the adaptive controller measures at a step (identical on every worker).

  Attributes:
    counts: int32 ``[n, P]`` elements of each worker's partition with
      ``|a| >= thresholds[p]``.
    largest: float32 the largest ``|a|`` in any worker's partition: the one
      point of the count curve known without probing (one element passes
      it, none passes above), so the controller can find the threshold
      again after any jump of the gradient scale, and keeps its threshold
      when there is nothing at all to select.
  """

  counts: jax.Array
  largest: jax.Array


class Budget(NamedTuple):
  """What a step may send (static).

  Attributes:
    target: ``k``, the indices the user asked to transmit per step.
    capacity: ``C``, index slots in each worker's buffer.
    slots: ``M``, values summed per step (all ``n C`` buffer slots, or
      fewer when the gathered indices are packed first).
  """

  target: int
  capacity: int
  slots: int


def probe_thresholds(previous: jax.Array) -> jax.Array:
  """float32 ``[P]``: the adaptive controller's probes around the last threshold, ascending."""
  return previous * jnp.asarray(ADAPTIVE_PROBE_RATIOS, jnp.float32)


def measure_partitions(
    accumulated: jax.Array, begin: jax.Array, end: jax.Array, thresholds: jax.Array, *,
    chunk: int, unrolled: int, axis_name: str,
) -> ProbeCounts:
  """Every worker's count at ``thresholds`` in its own partition ``accumulated[begin:end]``.

  Each worker counts its own partition in place, chunk by chunk
  (`_selection.count_in_range`), and one ``all_gather`` gives every worker
  every worker's counts and largest magnitude.

  Args:
    accumulated: float32 ``[N]`` this worker's accumulated gradient.
    begin: int32 first index of this worker's partition.
    end: int32 one past its last index.
    thresholds: float32 ``[P]`` the probes (`probe_thresholds`).
    chunk: static elements per iteration (`_selection.chunk_length`).
    unrolled: static iterations unrolled on GPUs (`_selection.over_chunks`).
    axis_name: the data-parallel axis.

  Returns:
    The gathered `ProbeCounts`.
  """
  counts, largest = _selection.count_in_range(
      accumulated, begin, end, thresholds, chunk=chunk, unrolled=unrolled)
  return gathered_probe(_collectives.all_gather(probe_row(counts, largest), axis_name))


def probe_row(counts: jax.Array, largest: jax.Array) -> jax.Array:
  """int32 ``[P + 1]``: a worker's probe counts and its largest ``|a|`` (bits), to gather."""
  return jnp.concatenate([counts, _collectives.float_bits(largest)[None]])


def gathered_probe(rows: jax.Array) -> ProbeCounts:
  """The `ProbeCounts` of every worker's `probe_row`, all-gathered as ``[n, P + 1]``."""
  return ProbeCounts(rows[:, :-1], _collectives.bits_float(jnp.max(rows[:, -1])))


class ThresholdController(NamedTuple):
  """A threshold rule.

  Attributes:
    name: ``"reference"`` or ``"adaptive"``.
    initial_threshold: ``k -> threshold`` before the first step.
    choose: ``(previous_threshold, previous_selected, budget, correction,
      step, probe) -> (threshold, steady)`` for this step; ``probe`` holds
      every worker's count of this step's accumulated gradient passing
      `probe_thresholds` of the previous threshold (`ProbeCounts`; None for
      a rule without probes), ``budget`` is the step's `Budget`
      and ``correction`` the factor on ``k`` that `correct` learns from
      ``steady`` steps (the reference rule ignores it and is never steady).
    num_probes: how many thresholds ``choose`` measures per step (the int32
      counts it all-gathers, besides the largest magnitude).
  """

  name: str
  initial_threshold: Callable[[int], float]
  choose: Callable[
      [jax.Array, jax.Array, Budget, jax.Array, jax.Array, ProbeCounts | None],
      tuple[jax.Array, jax.Array],
  ]
  num_probes: int


def hard_threshold_rule(target: int) -> float:
  """``1 / (2 sqrt(k))``: the hard-threshold rule of Sahu et al."""
  return 1.0 / (2.0 * math.sqrt(target))


def reference_factor(selected: jax.Array, target: int) -> jax.Array:
  """The published multiplicative step for the previous count ``K``."""
  target = jnp.int32(target)
  return jnp.where(
      _integer.exceeds_ratio(selected, target, *REFERENCE_UPPER),
      jnp.float32(REFERENCE_FACTORS[0]),
      jnp.where(
          _integer.exceeds_ratio(selected, target, *REFERENCE_LOWER),
          jnp.float32(REFERENCE_FACTORS[1]),
          jnp.float32(REFERENCE_FACTORS[2]),
      ),
  )


def _reference_choose(previous, selected, budget, correction, step, probe):
  del correction, probe
  threshold = jnp.where(step == 0, previous, previous * reference_factor(selected, budget.target))
  return threshold, jnp.zeros((), bool)


def _adaptive_choose(previous, selected, budget, correction, step, probe):
  """Steers the indices *transmitted* to ``k``, never selecting more than can be sent.

  Each worker's buffer takes ``min(count, C)`` of what passes in its
  partition (where a spill's shared slots fill up, fewer are sent: the rest
  is overflow); the threshold is where the sum of those meets ``k`` times
  ``correction`` (see `correct`). The ``M`` value slots are not a cap on
  that curve: capped at ``M`` it would flatten just above ``k`` and the
  interpolation would land too low. Instead the threshold is never so low
  that more than ``min(n C, M)`` elements pass in all (a capacity below
  ``k`` then caps the density, instead of the threshold falling without
  end). Where that floor binds because full buffers hold the curve short of
  ``k``, the threshold rises until the first full buffer comes down to ``C``
  while the other workers lose at most ``ADAPTIVE_RELIEF_LOSS k``
  (`_count_curve.relieve_full_buffers`): lower, it would mostly pass what
  cannot be sent. With nothing to select
  anywhere (``largest == 0``) the threshold stays where it is.

  Returns:
    ``(threshold, steady)``: ``steady`` when the threshold was interpolated
    between measured points of the transmitted curve (no transient), the
    steps `correct` learns from.
  """
  del selected, step
  thresholds = probe_thresholds(previous)
  num_workers = probe.counts.shape[0]
  sendable = min(num_workers * budget.capacity, budget.slots)
  transmitted = jnp.sum(jnp.minimum(probe.counts, budget.capacity), axis=0)
  passed = jnp.sum(probe.counts, axis=0)
  steered, inside = _count_curve.solve_count_curve(
      thresholds, transmitted, budget.target * correction, probe.largest, return_inside=True
  )
  capped = _count_curve.solve_count_curve(thresholds, passed, sendable, probe.largest)
  threshold = jnp.maximum(steered, capped)
  # Where that floor binds, full buffers hold the curve short of k: a lower
  # threshold would mostly pass what they cannot send.
  probed = (threshold >= thresholds[0]) & (threshold <= thresholds[-1])
  relieved = _count_curve.relieve_full_buffers(
      thresholds, probe.counts, threshold, capacity=budget.capacity,
      allowed_loss=ADAPTIVE_RELIEF_LOSS * budget.target,
  )
  threshold = jnp.where((steered < capped) & probed, relieved, threshold)
  something = probe.largest > 0
  threshold = jnp.where(something, threshold, previous)
  threshold = jnp.clip(threshold, jnp.finfo(jnp.float32).tiny, jnp.finfo(jnp.float32).max)
  return threshold, inside & (steered >= capped) & something


def correct(
    correction: jax.Array, transmitted: jax.Array, target: int, steady: jax.Array
) -> jax.Array:
  """The adaptive controller's target factor after a step: integral feedback.

  Interpolating the count curve between probes is biased where error
  feedback piles magnitudes up just below the previous threshold (a cliff
  inside a segment): with probes 1/64 of an octave apart, the realized count
  ran 12 % above the interpolated one late in training on the
  1.1M-parameter MLP of ``benchmarks/density_control.py``. On steady steps the factor moves by
  ``CORRECTION_RATE * log(k / transmitted)`` in log space (at most
  ``CORRECTION_STEP``, within ``CORRECTION_RANGE``), so a persistent bias is
  removed in a few steps; transients leave it alone.

  Args:
    correction: float32 the factor the step aimed at (``k * correction``).
    transmitted: int32 indices the step transmitted.
    target: ``k``.
    steady: bool, whether the step's threshold was interpolated.

  Returns:
    The float32 factor for the next step.
  """
  error = jnp.log(jnp.float32(target)) - jnp.log(jnp.maximum(transmitted, 1).astype(jnp.float32))
  moved = jnp.log(correction) + jnp.clip(CORRECTION_RATE * error, -CORRECTION_STEP, CORRECTION_STEP)
  low, high = (math.log(x) for x in CORRECTION_RANGE)
  return jnp.where(steady, jnp.exp(jnp.clip(moved, low, high)), correction).astype(jnp.float32)


CONTROLLERS = types.MappingProxyType({
    "reference": ThresholdController("reference", hard_threshold_rule, _reference_choose, 0),
    "adaptive": ThresholdController(
        "adaptive", hard_threshold_rule, _adaptive_choose, len(ADAPTIVE_PROBE_RATIOS)
    ),
})


def control_bytes(controller: ThresholdController, num_workers: int) -> int:
  """Bytes one worker sends per step for ``controller``'s measurement.

  The adaptive controller all-gathers its ``P`` probe counts and its largest
  magnitude (``P + 1`` int32); the reference rule sends nothing.
  """
  if not controller.num_probes:
    return 0
  return _collectives.ring_all_gather_bytes(
      num_workers, (controller.num_probes + 1) * _collectives.INDEX_BYTES
  )


def get_controller(name: str) -> ThresholdController:
  """Returns the threshold controller called ``name``.

  Args:
    name: ``"adaptive"`` or ``"reference"``.

  Returns:
    The `ThresholdController`.

  Raises:
    ValueError: for any other name.
  """
  if name not in CONTROLLERS:
    raise ValueError(
        f"Unknown controller {name!r}; expected 'adaptive' (default: measures this "
        "step's count curve and holds the target density) or 'reference' (the "
        "published rule, exactly)."
    )
  return CONTROLLERS[name]
