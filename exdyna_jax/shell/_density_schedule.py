"""Density schedules: ``{first_step: density}``, each level compiled once.

A sparsifier's ``density`` fixes the sizes of its buffers, so it cannot be
traced. A schedule lists the levels up front; the step compiles one branch
per level (its own static buffers) and a ``lax.switch`` on the completed
step count picks the current one, so the bytes sent each step are those of
the current level, not the largest. A level of ``1.0`` is an exact dense
all-reduce of the accumulated gradient (residual and gradient both sent,
the residual cleared; as with `exdyna_jax.dense`, what rounding the mean to
a bfloat16 or float16 leaf loses is not kept). The residual and the
method's state carry over between levels unchanged.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.extend
import jax.numpy as jnp

from exdyna_jax.core import _collectives, _options, _stats
from exdyna_jax.exchange import _exchange

# (accumulated [N], state, n) -> (aggregated update, new state): one level's step.
StepFn = Callable[[jax.Array, Any, int], tuple[_exchange.SparseUpdate, Any]]

class Level(NamedTuple):
  """One level of a density schedule: ``density`` from ``first_step`` on."""

  first_step: int
  density: float


def density_levels(density: float | Mapping[int, float]) -> tuple[Level, ...]:
  """The levels of ``density``: one for a number, one per key of a mapping.

  Args:
    density: a density in ``(0, 1]``, or a mapping ``{first_step: density}``
      with a key 0, every key a non-negative int and at least one density
      below 1 (1.0 is a dense all-reduce).

  Returns:
    The levels, by first step.

  Raises:
    TypeError, ValueError: for anything else, saying what is expected.
  """
  if not isinstance(density, Mapping):
    return (Level(0, _options.check_density(density)),)
  levels = []
  for first_step, level_density in density.items():
    if isinstance(first_step, bool) or not isinstance(first_step, numbers.Integral):
      raise TypeError(
          f"A density schedule maps first steps (ints) to densities, got key {first_step!r}."
      )
    if not 0 <= first_step <= _stats.INT32_MAX:
      raise ValueError(
          f"A density schedule's first steps must be in [0, {_stats.INT32_MAX}] (the step "
          f"counter is int32), got {first_step}."
      )
    levels.append(Level(int(first_step), _options.check_density(level_density)))
  levels.sort()
  if not levels or levels[0].first_step != 0:
    raise ValueError(
        "A density schedule needs a density for step 0, e.g. {0: 1.0, 500: 0.01}; got "
        f"first steps {[level.first_step for level in levels]}."
    )
  if all(level.density == 1.0 for level in levels):
    raise ValueError(
        "Every level of the density schedule is 1.0 (dense): use exdyna_jax.dense()."
    )
  return tuple(levels)


def initial_density(levels: tuple[Level, ...]) -> float:
  """The density of the first level below 1 (what a state starts for), or 1.0."""
  return next((level.density for level in levels if level.density < 1.0), 1.0)


def initial_count(levels: tuple[Level, ...], num_elements: int) -> int:
  """``k`` of the first level below 1 (what a state starts for, a threshold say).

  Raises:
    ValueError: if any level selects ``floor(density * N) = 0`` elements.
  """
  for level in levels:
    _options.target_count(level.density, num_elements)
  return _options.target_count(initial_density(levels), num_elements)


def dgc_warmup(
    density: float, *, steps_per_level: int, start: float = 0.25, factor: float = 4.0
) -> dict[int, float]:
  """A DGC-style warm-up: the density falls by ``factor`` every ``steps_per_level`` steps.

  Deep Gradient Compression (Lin et al., ICLR 2018) warms the density up
  exponentially over the first epochs, 25 %, 6.25 %, 1.56 %, 0.4 % and then
  0.1 %, so that the residual has time to build up; this returns that
  schedule for any final density.

  Args:
    density: the final density, in ``(0, 1]``.
    steps_per_level: steps at each warm-up level (DGC: one epoch).
    start: the first density (DGC: 0.25); 1.0 starts with dense steps.
    factor: the ratio of one level to the next, above 1.

  Returns:
    ``{first_step: density}`` for the ``density`` argument of any
    sparsifier.

  Example:
    >>> import exdyna_jax
    >>> exdyna_jax.dgc_warmup(0.001, steps_per_level=100)
    {0: 0.25, 100: 0.0625, 200: 0.015625, 300: 0.00390625, 400: 0.001}
  """
  density = _options.check_density(density)
  start = _options.check_density(start)
  steps_per_level = _options.check_positive_int(steps_per_level, "steps_per_level")
  if not factor > 1.0 or math.isinf(factor):
    raise ValueError(f"factor must be above 1 and finite, got {factor!r}.")
  schedule, level_density = {}, start
  while level_density > density:
    schedule[len(schedule) * steps_per_level] = level_density
    level_density /= factor
  schedule[len(schedule) * steps_per_level] = density
  return schedule


def scheduled_step(
    levels: tuple[Level, ...], step_for: Callable[[float], StepFn], axis_name: str
) -> StepFn:
  """One step over all levels: each level's branch, chosen by the completed step count.

  Args:
    levels: from `density_levels`; a single level gives ``step_for`` of it.
    step_for: ``density -> step`` of the method at that density.
    axis_name: the data-parallel axis (for a dense level's ``psum``).

  Returns:
    The step. Its `SparseUpdate` has as many slots as the largest level's;
    where a level is dense it carries the mean in ``base`` and
    ``sent_all=True``.
  """
  if len(levels) == 1 and levels[0].density < 1.0:
    return step_for(levels[0].density)
  steps = [None if level.density == 1.0 else step_for(level.density) for level in levels]
  first_steps = [level.first_step for level in levels]
  has_dense = None in steps

  def step(accumulated, state, num_workers):
    num_elements = accumulated.shape[0]
    recorded = [  # each level's step traced once, replayed in its branch (`replay`)
        None if s is None else jax.make_jaxpr(
            lambda s=s: s(accumulated, state, num_workers), return_shape=True)()
        for s in steps
    ]
    shapes = [record[1][0] for record in recorded if record] or [
        _exchange.SparseUpdate(jax.ShapeDtypeStruct((1,), jnp.int32),  # density 1.0 only
                               jax.ShapeDtypeStruct((1,), accumulated.dtype))]
    slots = max(shape.indices.shape[0] for shape in shapes)

    def padded(sparse):
      live = sparse.indices.shape[0]
      pad = slots - live
      sparse = _exchange.SparseUpdate(
          jnp.pad(sparse.indices, (0, pad), constant_values=num_elements),
          jnp.pad(sparse.values, (0, pad)),
          None if sparse.kept is None else jnp.pad(sparse.kept, (0, pad)),
          live=jnp.int32(live),
      )
      if has_dense:
        sparse = sparse._replace(
            base=jnp.zeros((num_elements,), sparse.values.dtype), sent_all=jnp.bool_(False)
        )
      return sparse

    def sparse_branch(record):
      def run():
        sparse, new_state = replay(*record)()
        return padded(sparse), new_state._replace(residual=None)

      return run

    def dense_branch():
      mean = jax.lax.psum(accumulated, axis_name) / num_workers
      count = jnp.int32(num_elements)
      stats = state.stats._replace(
          selected=count,
          transmitted=count,
          target=count,
          overflow=jnp.zeros((), jnp.int32),
          **_stats.bytes_fields(state.stats, _collectives.ring_all_reduce_bytes(
              num_workers, num_elements * _collectives.VALUE_BYTES)),
      )
      nothing = _exchange.SparseUpdate.nothing(shapes[0], num_elements, axis_name)
      nothing = padded(nothing)._replace(base=mean, sent_all=jnp.bool_(True), live=jnp.int32(0))
      return nothing, state._replace(residual=None, stats=stats)

    branches = [sparse_branch(record) if record else dense_branch for record in recorded]
    level = jnp.sum(state.stats.step >= jnp.asarray(first_steps, jnp.int32)) - 1
    sparse, new_state = jax.lax.switch(level, branches)
    return sparse, new_state._replace(residual=state.residual)

  return step


def replay(program: Any, shapes: Any) -> Callable[[], Any]:
  """``fn``'s output again, from ``jax.make_jaxpr(fn, return_shape=True)()``'s pair.

  A branch of a ``lax.switch`` whose output shapes another branch needs
  first: recording ``fn`` once and replaying its program runs none of the
  method's Python a second time (an ``eval_shape`` and the branch would
  trace it twice).
  """
  return lambda: jax.tree.unflatten(
      jax.tree.structure(shapes), jax.extend.core.jaxpr_as_fun(program)())
