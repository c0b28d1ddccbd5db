"""``exdyna(controller="reference")`` is ExDyna as published (docs/algorithms.md).

The JAX transform runs over simulated workers and is compared, step by step,
with an independent NumPy model written from the specification
(`tests/models/exdyna_model.py`): the float32 threshold, the partition starts
and sizes, the per-partition workloads, the selected, transmitted and overflow
counts must be identical; residuals must be identical bit for bit (they are
the worker's own float32 accumulated gradient with the transmitted indices
cleared); updates must match up to the rounding of a float32 cross-worker sum.

The gradients are designed so that every rule of the algorithm fires: they
are heavy-tailed (Student-t) with a scale that varies by two orders of
magnitude along the flat vector and is negligible in its first 13 %, so
partitions are unevenly loaded and move; they are negligible everywhere at
step 0, so every worker sends its fallback index; and their overall scale
drops after a burst, so the threshold rule visits all three bands.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import pytest

import exdyna_jax
from tests.harness import run_pmap, run_shard_map, run_vmap, unflatten_like
from tests.models.exdyna_model import (
  THRESHOLD_CREEP_FACTOR,
  THRESHOLD_DOWN_FACTOR,
  THRESHOLD_UP_FACTOR,
  ExDynaModel,
  StepRecord,
)

DENSITY = 0.01
NUM_BLOCKS = 64
NUM_STEPS = 120
# A multi-leaf tree with mixed ranks; flat order is jax.tree.leaves order
# (conv, dense/bias, dense/kernel, embed, scale): N = 51735.
LEAF_SHAPES = {
    "conv": (3, 3, 16, 32),
    "dense": {"kernel": (256, 160), "bias": (160,)},
    "embed": (60, 100),
    "scale": (7,),
}
# Per-step gradient scale: negligible at step 0 (nothing passes anywhere),
# a burst (the threshold rises), then a lower plateau (it falls and settles).
SCALE_SCHEDULE = ((0, 1e-3), (1, 1.0), (20, 0.4))
BASE_SCALE = 5e-4
NEGLIGIBLE_FRACTION = 0.13
# |impl - exact| <= UPDATE_RTOL * mean_w |a_w|: a float32 sum of n <= 8 terms
# and one division round to well under this.
UPDATE_RTOL = 1e-6


def _is_shape(node: Any) -> bool:
  return isinstance(node, tuple)


def params_template() -> Any:
  """Zero parameters with the test's tree structure."""
  return jax.tree.map(lambda shape: np.zeros(shape, np.float32), LEAF_SHAPES, is_leaf=_is_shape)


def num_elements() -> int:
  """``N`` of the test's parameter tree."""
  return sum(leaf.size for leaf in jax.tree.leaves(params_template()))


def flat_to_tree(flat: np.ndarray) -> Any:
  """``[..., N]`` -> tree whose leaves are ``[..., *leaf_shape]``, in leaves order."""
  return unflatten_like(flat, params_template())


def tree_to_flat(tree: Any, num_lead_dims: int) -> np.ndarray:
  """Inverse of `flat_to_tree` for leaves with ``num_lead_dims`` leading axes."""
  leaves = [np.asarray(leaf) for leaf in jax.tree.leaves(tree)]
  return np.concatenate(
      [leaf.reshape((*leaf.shape[:num_lead_dims], -1)) for leaf in leaves], axis=-1
  )


def heavy_tailed_gradients(num_workers: int, num_steps: int, seed: int) -> np.ndarray:
  """Flat float32 local gradients ``[n, steps, N]``, a different draw per worker and step."""
  size = num_elements()
  position = np.arange(size) / size
  profile = np.exp(
      2.0 * np.sin(2 * np.pi * 1.3 * position + 0.4) + np.sin(2 * np.pi * 5.1 * position)
  )
  profile[: int(NEGLIGIBLE_FRACTION * size)] = 1e-6
  step_scale = np.ones(num_steps)
  for first_step, scale in SCALE_SCHEDULE:
    step_scale[first_step:] = scale
  noise = np.random.default_rng(seed).standard_t(3, size=(num_workers, num_steps, size))
  scale = (BASE_SCALE * step_scale[:, None] * profile).astype(np.float32)  # [steps, N]
  return np.multiply(noise, scale, dtype=np.float32)  # one float32 pass over the draws


def reference_transform(capacity_factor: float) -> Any:
  """The transform under test: the published threshold rule, ``B = NUM_BLOCKS``."""
  return exdyna_jax.exdyna(
      DENSITY, num_blocks=NUM_BLOCKS, capacity_factor=capacity_factor, controller="reference"
  )


def run_model(
    flat_grads: np.ndarray, capacity_factor: float
) -> tuple[ExDynaModel, list[StepRecord]]:
  """Runs the NumPy model on ``[n, steps, N]`` flat gradients."""
  num_workers, _, size = flat_grads.shape
  model = ExDynaModel(size, num_workers, DENSITY, NUM_BLOCKS, capacity_factor)
  return model, model.run(flat_grads)


def worker_invariant(stacked: np.ndarray, name: str) -> np.ndarray:
  """Checks a ``[n, steps, ...]`` statistic is identical on all workers; returns worker 0's."""
  stacked = np.asarray(stacked)
  for worker in range(1, stacked.shape[0]):
    np.testing.assert_array_equal(stacked[worker], stacked[0], err_msg=f"{name}: worker {worker}")
  return stacked[0]


def assert_step_matches(
    record: StepRecord,
    stats: dict[str, np.ndarray],
    updates: np.ndarray,
    residuals: np.ndarray,
    step: int,
) -> None:
  """Compares model step ``step`` with the implementation's outputs at that step.

  Args:
    record: the model's record of the step.
    stats: worker-invariant statistics, each ``[steps, ...]``.
    updates: ``[n, steps, N]`` per-worker flat updates.
    residuals: ``[n, steps, N]`` per-worker flat residuals after each step.
    step: the step index ``t``.
  """
  where = f"step {step}"
  assert stats["step"][step] == record.step, where
  assert stats["threshold"][step].dtype == np.float32
  assert stats["threshold"][step] == record.threshold, (
      f"{where}: threshold {stats['threshold'][step]!r} != model {record.threshold!r}"
  )
  for field in ("partition_starts", "partition_sizes", "workloads"):
    np.testing.assert_array_equal(
        stats[field][step], getattr(record, field), err_msg=f"{where}: {field}"
    )
  for field in ("selected", "transmitted", "overflow"):
    assert int(stats[field][step]) == getattr(record, field), (
        f"{where}: {field} {int(stats[field][step])} != model {getattr(record, field)}"
    )
  for worker in range(updates.shape[0]):
    error = np.abs(updates[worker, step].astype(np.float64) - record.update)
    bound = UPDATE_RTOL * record.update_scale
    worst = int(np.argmax(error - bound))
    assert np.all(error <= bound), (
        f"{where}, worker {worker}: update[{worst}] = {updates[worker, step, worst]!r}, "
        f"model {record.update[worst]!r}"
    )
  np.testing.assert_array_equal(residuals[:, step], record.residuals, err_msg=f"{where}: residual")


def implementation_outputs(updates_tree: Any, states: Any) -> tuple[np.ndarray, np.ndarray, dict]:
  """Flat updates, flat residuals and worker-invariant statistics of a harness run."""
  updates = tree_to_flat(updates_tree, num_lead_dims=2)
  residuals = np.asarray(states.residual)
  size = updates.shape[-1]
  # Any padding past N must stay empty.
  assert not np.any(residuals[..., size:])
  stats = {
      name: worker_invariant(value, name) for name, value in states.stats._asdict().items()
  }
  return updates, residuals[..., :size], stats


def accumulated_gradients(flat_grads: np.ndarray, residuals: np.ndarray) -> np.ndarray:
  """``a_w = g_w + m_w(previous step)`` in float64, ``[n, steps, N]``, from a run's residuals."""
  previous_residuals = np.concatenate([np.zeros_like(residuals[:, :1]), residuals[:, :-1]], axis=1)
  return flat_grads.astype(np.float64) + previous_residuals.astype(np.float64)


def threshold_factors_used(thresholds: np.ndarray) -> set[str]:
  """Which of the published factors moved the threshold between consecutive steps."""
  named = {
      "up": THRESHOLD_UP_FACTOR,
      "creep": THRESHOLD_CREEP_FACTOR,
      "down": THRESHOLD_DOWN_FACTOR,
  }
  used = set()
  for previous, current in itertools.pairwise(thresholds):
    matching = [name for name, factor in named.items() if np.float32(previous * factor) == current]
    assert len(matching) == 1, f"threshold {previous!r} -> {current!r} by no published factor"
    used.add(matching[0])
  return used


def assert_fallback_indices_sent(
    records: list[StepRecord],
    stats: dict[str, np.ndarray],
    updates: np.ndarray,
    block_size: int,
) -> None:
  """Where nothing passed in a partition, exactly ``begin + (t mod length)`` was sent there.

  Checked on the implementation's own update and partition statistics; the
  model only says which (step, partition) pairs had nothing passing.
  """
  num_workers, _, size = updates.shape
  for step, record in enumerate(records):
    for partition in record.fallback_partitions:
      begin = int(stats["partition_starts"][step, partition]) * block_size
      if partition == num_workers - 1:
        end = size
      else:
        end = begin + int(stats["partition_sizes"][step, partition]) * block_size
      sent = begin + np.flatnonzero(updates[0, step, begin:end])
      np.testing.assert_array_equal(
          sent, [begin + step % (end - begin)], err_msg=f"step {step}, partition {partition}"
      )
      assert stats["workloads"][step, partition] == 1


@functools.lru_cache(maxsize=1)
def vmap_run(num_workers: int, capacity_factor: float) -> tuple[np.ndarray, Any, Any]:
  """Flat gradients and the reference transform's run under ``vmap``.

  The last run is cached: the device tests reuse the 8-worker one.
  """
  flat_grads = heavy_tailed_gradients(num_workers, NUM_STEPS, seed=num_workers)
  updates, states, _ = run_vmap(
      reference_transform(capacity_factor), params_template(), flat_to_tree(flat_grads)
  )
  return flat_grads, jax.device_get(updates), jax.device_get(states)


@pytest.mark.parametrize("num_workers", [2, 3, 8])
def test_reference_mode_matches_model_step_by_step(num_workers: int) -> None:
  """Every step's threshold, partitions, counts, update and residuals are the model's."""
  capacity_factor = 2.0
  flat_grads, updates_tree, states = vmap_run(num_workers, capacity_factor)
  updates, residuals, stats = implementation_outputs(updates_tree, states)
  model, records = run_model(flat_grads, capacity_factor)

  for step, record in enumerate(records):
    assert_step_matches(record, stats, updates, residuals, step)

  # The run exercised every rule, so the comparison above could have failed.
  sizes = stats["partition_sizes"]
  assert np.any(sizes != sizes[0]), "no partition ever moved"
  assert sum(record.blocks_moved for record in records) >= 10
  assert np.all(4 * num_workers * sizes >= NUM_BLOCKS), "a partition shrank below B / (4n)"
  assert len(records[0].fallback_partitions) == num_workers, "step 0 sends only fallbacks"
  if num_workers > 2:
    # Some partitions stay inside the negligible region after step 0.
    assert any(record.fallback_partitions for record in records[1:])
  assert_fallback_indices_sent(records, stats, updates, model.geometry.block_size)
  assert stats["selected"][0] == num_workers
  assert threshold_factors_used(stats["threshold"]) == {"up", "creep", "down"}
  assert stats["threshold"][0] == np.float32(1 / (2 * np.sqrt(model.target)))


def test_capacity_overflow_stays_in_residual() -> None:
  """A worker sends its C lowest passing indices; the rest stay in its residual."""
  num_workers, num_steps, capacity_factor = 3, 60, 0.5
  flat_grads = heavy_tailed_gradients(num_workers, num_steps, seed=11)
  updates_tree, states, _ = run_vmap(
      reference_transform(capacity_factor), params_template(), flat_to_tree(flat_grads)
  )
  updates, residuals, stats = implementation_outputs(
      jax.device_get(updates_tree), jax.device_get(states)
  )
  model, records = run_model(flat_grads, capacity_factor)
  # ceil(0.5 * 517 / 3) = 87 indices per worker.
  assert model.capacity == 87

  for step, record in enumerate(records):
    assert_step_matches(record, stats, updates, residuals, step)

  overflow = stats["overflow"]
  np.testing.assert_array_equal(overflow, stats["selected"] - stats["transmitted"])
  assert np.count_nonzero(overflow > 0) >= num_steps // 2
  assert np.all(stats["transmitted"] <= num_workers * model.capacity)
  # The update is nonzero exactly at the transmitted indices.
  np.testing.assert_array_equal(np.count_nonzero(updates[0], axis=-1), stats["transmitted"])

  # Conservation, from the implementation's own outputs: what was not sent is
  # in the residuals, sum_w m_w(new) + n * update == sum_w (g_w + m_w(old)).
  accumulated = accumulated_gradients(flat_grads, residuals)
  kept_plus_sent = residuals.astype(np.float64).sum(axis=0) + num_workers * updates[0]
  scale = np.abs(accumulated).sum(axis=0)
  assert np.all(np.abs(kept_plus_sent - accumulated.sum(axis=0)) <= 1e-5 * scale)


@pytest.mark.parametrize("runner", [run_pmap, run_shard_map], ids=["pmap", "shard_map"])
def test_reference_mode_is_the_same_on_real_devices(runner: Callable[..., Any]) -> None:
  """pmap and shard_map over 8 CPU devices give the vmap run's results."""
  num_workers, num_steps, capacity_factor = 8, 30, 2.0
  flat_grads, vmap_updates, vmap_states = vmap_run(num_workers, capacity_factor)
  grads = flat_to_tree(flat_grads[:, :num_steps])
  updates_tree, states, _ = runner(reference_transform(capacity_factor), params_template(), grads)
  updates, residuals, stats = implementation_outputs(
      jax.device_get(updates_tree), jax.device_get(states)
  )
  expected_updates, expected_residuals, expected_stats = implementation_outputs(
      vmap_updates, vmap_states
  )

  for name, value in stats.items():
    np.testing.assert_array_equal(value, expected_stats[name][:num_steps], err_msg=name)
  np.testing.assert_array_equal(residuals, expected_residuals[:, :num_steps])
  # Only the order of the cross-worker float32 sum may differ.
  scale = np.abs(accumulated_gradients(flat_grads[:, :num_steps], residuals)).mean(axis=0)
  difference = np.abs(updates - expected_updates[:, :num_steps])
  assert np.all(difference <= 2 * UPDATE_RTOL * scale)
  # Partitions did move within these steps.
  assert np.any(stats["partition_sizes"] != stats["partition_sizes"][0])


def test_partition_grown_past_the_selection_window_still_matches_model() -> None:
  """Selection scans a slice of twice the fair share; longer partitions scan everything.

  The last quarter of the vector is negligible, so the last partition keeps
  taking blocks from its overloaded neighbour until it is longer than the
  slice, and the run switches to the whole-vector branch mid-way. Both
  branches must give the model's results.
  """
  num_workers, num_steps, capacity_factor = 8, 80, 4.0
  size = num_elements()
  profile = np.ones(size)
  profile[3 * size // 4 :] = 1e-6
  noise = np.random.default_rng(5).standard_t(3, size=(num_workers, num_steps, size))
  flat_grads = (BASE_SCALE * profile * noise).astype(np.float32)
  updates_tree, states, _ = run_vmap(
      reference_transform(capacity_factor), params_template(), flat_to_tree(flat_grads)
  )
  updates, residuals, stats = implementation_outputs(
      jax.device_get(updates_tree), jax.device_get(states)
  )
  model, records = run_model(flat_grads, capacity_factor)
  for step, record in enumerate(records):
    assert_step_matches(record, stats, updates, residuals, step)

  window = 2 * -(-size // num_workers)
  geometry = model.geometry
  remainder = size - geometry.num_blocks * geometry.block_size
  longest = stats["partition_sizes"].max(axis=1) * geometry.block_size + remainder
  assert longest[0] <= window < longest[-1], "the run never left the window branch"
