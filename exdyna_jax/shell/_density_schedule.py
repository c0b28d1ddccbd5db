"""Density schedules: ``{first_step: density}``, each level compiled once.

A sparsifier's ``density`` fixes the sizes of its buffers, so it cannot be
traced. A schedule lists the levels up front; the step compiles one branch
per level (its own static buffers, its own writes of the update and the
residual) and a ``lax.switch`` on the completed step count picks the
current one, so the bytes sent and the work done each step are those of
the current level, not the largest. A level of ``1.0`` is an exact dense
all-reduce of the accumulated gradient (residual and gradient both sent,
the residual cleared; as with `exdyna_jax.dense`, what rounding the mean to
a bfloat16 or float16 leaf loses is not kept). The residual and the
method's state carry over between levels unchanged.
"""

from __future__ import annotations

import functools
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


class LevelSteps(NamedTuple):
  """A density schedule's steps: ``steps[i]`` from step ``first_steps[i]`` on.

  The shell runs the current level's step and writes its update inside one
  branch of a ``lax.switch`` (`by_level`), so each level's `SparseUpdate`
  keeps its own slots and a step costs its own level's writes only.
  """

  first_steps: tuple[int, ...]
  steps: tuple[StepFn, ...]


def scheduled_step(
    levels: tuple[Level, ...], step_for: Callable[[float], StepFn], axis_name: str
) -> StepFn | LevelSteps:
  """The step of each level: ``step_for(density)``, or `dense_step` at a density of 1.

  Args:
    levels: from `density_levels`.
    step_for: ``density -> step`` of the method at that density.
    axis_name: the data-parallel axis (for a dense level's ``psum``).

  Returns:
    The one level's step, or the `LevelSteps` of several.
  """
  steps = tuple(dense_step(axis_name) if level.density == 1.0 else step_for(level.density)
                for level in levels)
  if len(steps) == 1:
    return steps[0]
  return LevelSteps(tuple(level.first_step for level in levels), steps)


def dense_step(axis_name: str) -> StepFn:
  """A level of 1.0: the mean of the accumulated gradients, one ``psum`` (no slots).

  Its `SparseUpdate` has no indices: the mean is its ``base`` and
  ``sent_all`` clears the whole residual.
  """

  def step(accumulated, state, num_workers):
    num_elements = accumulated.shape[0]
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
    no_slots = _exchange.SparseUpdate(jnp.zeros((0,), jnp.int32), jnp.zeros((0,), mean.dtype))
    return no_slots._replace(base=mean, sent_all=jnp.bool_(True)), state._replace(stats=stats)

  return step


def by_level(schedule: LevelSteps, step: jax.Array, run: Callable[[StepFn], Any],
             axis_name: str) -> Any:
  """``run(schedule.steps[i])`` for the level ``i`` that ``step`` is in (one ``lax.switch``).

  Under ``vmap`` the step count is batched (one per worker, all equal) and
  a batched index would turn the switch into selects that run every
  branch; `_collectives.unbatched` makes it one value again. Under
  ``shard_map(check_vma=True)`` every output is typed varying where any
  branch's is.
  """
  level = jnp.sum(step >= jnp.asarray(schedule.first_steps, jnp.int32)) - 1
  branches = [functools.partial(run, level_step) for level_step in schedule.steps]
  return jax.lax.switch(_collectives.unbatched(level, axis_name),
                        typed_alike(branches, axis_name))


def typed_alike(branches: list[Callable[[], Any]], axis_name: str) -> list[Callable[[], Any]]:
  """``branches`` whose outputs are varying over ``axis_name`` where any branch's is.

  A level that keeps a state field as it came in (varying) and one that
  computes it from a ``psum`` (invariant) would give ``lax.switch`` two
  types. Each branch is traced once (`replay`).
  """
  if not _collectives.tracks_varying(axis_name):
    return branches
  recorded = [jax.make_jaxpr(branch, return_shape=True)() for branch in branches]
  varying = [any(_collectives.is_varying(leaf, axis_name) for leaf in leaves)
             for leaves in zip(*(jax.tree.leaves(shapes) for _, shapes in recorded), strict=True)]

  def cast(record):
    def run():
      leaves, tree = jax.tree.flatten(replay(*record)())
      return tree.unflatten([_collectives.per_worker(leaf, axis_name) if vary else leaf
                             for leaf, vary in zip(leaves, varying, strict=True)])

    return run

  return [cast(record) for record in recorded]


def replay(program: Any, shapes: Any) -> Callable[[], Any]:
  """``fn``'s output again, from ``jax.make_jaxpr(fn, return_shape=True)()``'s pair,
  without running ``fn``'s Python a second time."""
  return lambda: jax.tree.unflatten(
      jax.tree.structure(shapes), jax.extend.core.jaxpr_as_fun(program)())
