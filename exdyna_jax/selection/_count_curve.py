"""Measured count curves: how many elements pass a threshold, between probes.

The adaptive controller (`exdyna_jax.selection._threshold`) measures, each step, how
many elements of every worker's partition pass each of a few probe
thresholds. This module reads those curves: where a curve reaches a target
count (`solve_count_curve`), what it passes at a threshold (`count_at`),
both linear in log-log between probes, and how far a threshold at which
some buffers are full can rise while sending almost as much
(`relieve_full_buffers`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

MAX_EXTRAPOLATION = 4.0  # at most two octaves beyond the probes
SLOPE_RANGE = (-20.0, -0.1)  # d log K / d log threshold, clamped


def _log_points(thresholds: jax.Array, counts: jax.Array) -> tuple[jax.Array, jax.Array]:
  """A curve's points in log-log; a count of 0 reads as 1/2 (log defined, below 1)."""
  return jnp.log(thresholds), jnp.log(jnp.maximum(counts.astype(jnp.float32), 0.5))


def solve_count_curve(
    thresholds: jax.Array,
    counts: jax.Array,
    target: int | jax.Array,
    largest: jax.Array | None = None,
    *,
    return_inside: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
  """Threshold at which a measured count curve reaches ``target``.

  Args:
    thresholds: float32 ``[P]`` ascending probe thresholds.
    counts: int32 ``[P]`` elements passing each (non-increasing).
    target: the wanted count ``k``.
    largest: optional float32 largest magnitude, where the curve is known to
      be 1: it joins the probes as one more point (so a curve whose probes
      all lie above or all far below ``target`` is bracketed), and the result
      never exceeds it. When every probe passes the same number of
      elements, more than ``target`` (they all lie below the distribution),
      the result is ``largest / MAX_EXTRAPOLATION``, or the highest probe
      where that lies below it (then the next probes start higher), at
      most ``largest``.
    return_inside: also return whether the result was interpolated between
      two measured points (not extrapolated, not restarted).

  Returns:
    float32 threshold: log-log linear interpolation between the two points
    around ``target`` (with that segment's own slope, however steep), or,
    beyond the measured range, extrapolation with the end segment's slope
    clamped to ``SLOPE_RANGE``, at most ``MAX_EXTRAPOLATION`` beyond the end
    point.
  """
  probe_counts, highest_probe = counts, thresholds[-1]
  if largest is not None:
    thresholds = jnp.concatenate([thresholds, jnp.reshape(largest, (1,)).astype(jnp.float32)])
    counts = jnp.concatenate([counts, jnp.ones((1,), counts.dtype)])
    order = jnp.argsort(thresholds)
    thresholds, counts = thresholds[order], counts[order]
  log_thresholds, log_counts = _log_points(thresholds, counts)
  log_target = jnp.log(jnp.float32(target))
  # Segment j joins points j and j+1; counts fall as thresholds rise.
  segment = jnp.sum(log_counts[1:-1] > log_target).astype(jnp.int32)
  rise = log_counts[segment + 1] - log_counts[segment]
  run = log_thresholds[segment + 1] - log_thresholds[segment]
  below = log_target - log_counts[segment]  # <= 0 inside the measured range
  inside = (below <= 0) & (log_target >= log_counts[segment + 1])
  # Inside a segment its own slope, however steep (the result stays between
  # its points); beyond the ends the end slope, clamped.
  slope = jnp.where(run > 0, rise / jnp.where(run > 0, run, 1.0), 0.0)
  slope = jnp.where(inside, slope, jnp.clip(slope, *SLOPE_RANGE))
  step = jnp.where(inside & (rise == 0), 0.0, below / jnp.where(slope == 0, -1.0, slope))
  log_threshold = log_thresholds[segment] + step
  reach = math.log(MAX_EXTRAPOLATION)
  log_threshold = jnp.clip(log_threshold, log_thresholds[0] - reach, log_thresholds[-1] + reach)
  if largest is not None:
    log_threshold = jnp.minimum(log_threshold, jnp.log(largest))
    # Every probe passes the same elements, more than wanted: the probes lie
    # below the whole distribution and say nothing of its shape. Restart a
    # factor MAX_EXTRAPOLATION below the largest magnitude (as a
    # curve whose probes all lie above it does) instead of creeping up, but
    # never below the highest probe: a distribution within that factor of
    # its largest magnitude would bring the probes back below it every step.
    restart = jnp.maximum(jnp.log(largest) - reach, jnp.log(highest_probe))
    saturated = (probe_counts[0] == probe_counts[-1]) & (probe_counts[-1] > target)
    log_threshold = jnp.where(saturated, jnp.minimum(restart, jnp.log(largest)), log_threshold)
    inside = inside & ~saturated
  threshold = jnp.exp(log_threshold).astype(jnp.float32)
  return (threshold, inside) if return_inside else threshold


def count_at(thresholds: jax.Array, counts: jax.Array, threshold: jax.Array) -> jax.Array:
  """A measured count curve at ``threshold``, log-log linear between its probes.

  Args:
    thresholds: float32 ``[P]`` ascending probe thresholds.
    counts: int32 ``[P]`` elements passing each (non-increasing).
    threshold: float32 where to read the curve; outside the probes the
      nearest end segment is extended.

  Returns:
    float32 the interpolated count.
  """
  log_thresholds, log_counts = _log_points(thresholds, counts)
  log_threshold = jnp.log(threshold)
  segment = jnp.clip(
      jnp.searchsorted(log_thresholds, log_threshold, side="right", method="scan_unrolled") - 1,
      0, thresholds.shape[0] - 2,
  )
  run = log_thresholds[segment + 1] - log_thresholds[segment]
  fraction = (log_threshold - log_thresholds[segment]) / jnp.where(run > 0, run, 1.0)
  rise = log_counts[segment + 1] - log_counts[segment]
  return jnp.exp(log_counts[segment] + fraction * rise)


def relieve_full_buffers(
    thresholds: jax.Array,
    counts: jax.Array,
    threshold: jax.Array,
    *,
    capacity: int,
    allowed_loss: float,
) -> jax.Array:
  """Raises a threshold at which some buffers are full, while that sends almost as much.

  A worker that passes more than its ``C`` buffer slots sends its lowest
  ``C`` indices and keeps the rest, which would pass, in its residual
  (overflow). Raising the threshold keeps the ``C`` it sends until the first
  full worker comes down to ``C``, which then sends its ``C`` largest, and
  costs only what the other workers lose. The result is that point, but no
  higher than where the others would lose ``allowed_loss`` indices, and
  never below ``threshold``.

  Args:
    thresholds: float32 ``[P]`` ascending probe thresholds.
    counts: int32 ``[n, P]`` each worker's count at each probe.
    threshold: float32 the threshold chosen, inside the probes.
    capacity: ``C``, each worker's buffer slots.
    allowed_loss: how many transmitted indices the workers with room may
      lose.

  Returns:
    float32 the raised threshold (``threshold`` when no buffer is full).
  """
  at_threshold = jax.vmap(count_at, in_axes=(None, 0, None))(thresholds, counts, threshold)
  full = at_threshold > capacity
  down_to_capacity = jax.vmap(solve_count_curve, in_axes=(None, 0, None))(
      thresholds, counts, capacity
  )
  first_down = jnp.min(jnp.where(full, down_to_capacity, jnp.inf))
  # The workers with room may lose allowed_loss of what they send.
  room_counts = jnp.sum(jnp.where(full[:, None], 0, counts), axis=0)
  keep = jnp.sum(jnp.where(full, 0.0, at_threshold)) - allowed_loss
  affordable = jnp.where(
      keep > 0.5, solve_count_curve(thresholds, room_counts, jnp.maximum(keep, 0.5)), jnp.inf
  )
  raised = jnp.maximum(threshold, jnp.minimum(first_down, affordable))
  return jnp.where(jnp.any(full), raised, threshold)
