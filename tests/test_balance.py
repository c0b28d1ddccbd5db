"""Default ExDyna sends the density asked for: balanced partitions and a steered threshold.

The balanced partitioner is compared step by step with an independent NumPy
model (`tests/models/balance_model.py`); the density, overflow and
robustness targets are checked on gradient streams the partitioner was not
tuned on, the way a user runs it (default options).
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import exdyna_jax
from tests import harness
from tests.models import balance_model


def positional_stream(num_workers, steps, num_elements, *, seed=0, worker_scale=0.0):
  """Gaussian gradients under a hot spot and a hot tail along the vector.

  With ``worker_scale`` worker ``w``'s gradients are ``1 + worker_scale * w``
  times larger.
  """
  position = np.arange(num_elements) / num_elements
  profile = 0.2 + 3 * np.exp(-(((position - 0.3) / 0.02) ** 2)) + 2 * (position > 0.9)
  noise = np.random.default_rng(seed).standard_normal((num_workers, steps, num_elements))
  scale = 1 + worker_scale * np.arange(num_workers)
  return (noise * profile * scale[:, None, None]).astype(np.float32)


@functools.cache
def default_runner(density, num_workers, num_elements, element_steps):
  """A jitted vmap run of default ``exdyna(density)``; compiled once per shape."""
  tx = exdyna_jax.exdyna(density)
  params = jnp.zeros(num_elements)

  def per_worker(grads):
    def step(state, g):
      state = tx.update(g, state, params)[1]
      return state, state.stats

    return jax.lax.scan(step, tx.init(params), grads)[1]

  return jax.jit(jax.vmap(per_worker, axis_name=harness.AXIS, axis_size=num_workers),
                 compiler_options=harness.compiler_options(element_steps))


def run_stats(tx, flat_grads):
  """Worker 0's statistics at every step of a vmap run on flat gradients.

  ``tx`` a float: the default ``exdyna(tx)`` through `default_runner`.
  """
  if isinstance(tx, float):
    num_workers, _, num_elements = flat_grads.shape
    run = default_runner(tx, num_workers, num_elements, flat_grads.size)
    stats = run(jnp.asarray(flat_grads))
  else:
    _, states, _ = harness.run_vmap(tx, jnp.zeros(flat_grads.shape[-1]), jnp.asarray(flat_grads))
    stats = states.stats
  return jax.tree.map(lambda x: np.asarray(x)[0], stats)


def sent_density_error(stats, target, start=20):
  """``(median |transmitted / k - 1|, mean overflow / k)`` after ``start`` steps."""
  ratio = stats.transmitted[start:] / target
  return float(np.median(np.abs(ratio - 1))), float(np.mean(stats.overflow[start:]) / target)


# ------------------------------------------------------------------ the model


@pytest.mark.parametrize(("num_workers", "capacity_factor"), [(3, 1.0), (8, 1.0), (8, 6.0)])
def test_balanced_partitioner_matches_the_numpy_model_step_by_step(num_workers, capacity_factor):
  """Cut and estimate of every step are the model's, fed the step's exchange.

  ``capacity_factor=1`` makes buffers overflow often (so the overflow spread
  is exercised); 6 with ``spill=True`` spills the buffers' tails into the
  shared slots, which the first steps' uneven partitions fill (so a worker's
  overflow is what it did not send, not what did not fit its buffer). The
  update shows every transmitted index.
  """
  num_elements, density, steps = 20_000, 0.02, 25
  grads = positional_stream(num_workers, steps, num_elements, seed=num_workers, worker_scale=0.3)
  tx = exdyna_jax.exdyna(density, num_blocks=200, capacity_factor=capacity_factor, spill=True)
  updates, states, _ = harness.run_vmap(tx, jnp.zeros(num_elements), jnp.asarray(grads))
  updates = np.asarray(updates)[0]
  state = jax.tree.map(lambda x: np.asarray(x)[0], states)
  block_size, num_blocks = balance_model.block_layout(num_elements, 200)
  assert state.block_workloads.shape[-1] == num_blocks
  target = int(density * num_elements)
  capacity = -(-int(capacity_factor * target) // num_workers)

  residuals = np.asarray(states.residual)
  previous = np.concatenate([np.zeros_like(residuals[:, :1]), residuals[:, :-1]], axis=1)
  accumulated = grads + previous  # [n, steps, N], float32 as the library adds

  estimate = balance_model.block_lengths(num_elements, block_size, num_blocks) / num_elements
  scales = np.ones(num_workers)
  overflowed = spill_full = 0
  for t in range(steps):
    sizes = balance_model.cut(estimate, scales, t)
    np.testing.assert_array_equal(state.partition_sizes[t], sizes, err_msg=f"step {t}")
    ends = np.cumsum(sizes) * block_size
    ends[-1] = num_elements
    starts = np.concatenate([[0], ends[:-1]])
    transmitted, passed = [], []
    for worker in range(num_workers):
      begin, end = starts[(t + worker) % num_workers], ends[(t + worker) % num_workers]
      passing = np.abs(accumulated[worker, t, begin:end]) >= state.stats.threshold[t]
      passed.append(int(passing.sum()))
      sent = begin + np.flatnonzero(updates[t, begin:end])
      transmitted.append(list(sent) if passed[-1] else [])  # a fallback index carries nothing
    overflowed += state.stats.overflow[t] > 0
    buffered = sum(min(max(p, 1), capacity) for p in passed)  # what whole buffers send
    spill_full += state.stats.transmitted[t] < min(buffered, np.ceil(1.1 * target))
    estimate, scales = balance_model.observe(
        estimate, scales, sizes=sizes, step=t, transmitted=transmitted, passed=passed,
        num_elements=num_elements, block_size=block_size,
    )
    np.testing.assert_allclose(state.block_workloads[t], estimate, rtol=2e-4, atol=1e-7,
                               err_msg=f"step {t}")
    np.testing.assert_allclose(state.worker_scales[t], scales, rtol=2e-4, err_msg=f"step {t}")
    # Continue from the implementation's float32 estimate: a boundary near a tie
    # must not turn float64 rounding into a different cut.
    estimate = state.block_workloads[t].astype(np.float64)
    scales = state.worker_scales[t].astype(np.float64)
  if capacity_factor == 1.0:
    assert overflowed >= steps // 2, "buffers overflowed (the spread was exercised)"
  else:
    assert spill_full >= 1, "the shared slots filled up (what was sent was exercised)"
  assert np.any(state.partition_sizes[-1] != state.partition_sizes[0]), "partitions moved"


# ----------------------------------------------------------------- properties


@pytest.mark.parametrize("num_workers", [2, 5])
def test_partitions_cover_every_block_keep_one_each_and_agree_on_every_worker(num_workers):
  num_elements = 9_001
  grads = positional_stream(num_workers, 30, num_elements, seed=1)
  grads[:, :, : num_elements // 2] = 0.0  # a cold half: one partition takes all of it
  tx = exdyna_jax.exdyna(0.01)
  _, states, _ = harness.run_vmap(tx, jnp.zeros(num_elements), jnp.asarray(grads))
  sizes = np.asarray(states.partition_sizes)  # [worker, step, partition]
  num_blocks = np.asarray(states.block_workloads).shape[-1]
  np.testing.assert_array_equal(sizes, np.broadcast_to(sizes[:1], sizes.shape))
  np.testing.assert_array_equal(sizes.sum(-1), num_blocks)
  assert sizes.min() >= 1
  assert sizes[0, -1].max() * 2 > num_blocks, "the cold half went to one partition"


def test_residual_mass_is_conserved_with_packed_values_and_overflow():
  """sum_w m_new + n * update == sum_w (g + m_old) at every step."""
  num_workers, num_elements = 8, 30_000
  grads = positional_stream(num_workers, 40, num_elements, seed=2, worker_scale=0.25)
  tx = exdyna_jax.exdyna(0.01, capacity_factor=1.3)
  updates, states, _ = harness.run_vmap(tx, jnp.zeros(num_elements), jnp.asarray(grads))
  residuals = np.asarray(states.residual, np.float64)
  previous = np.concatenate([np.zeros_like(residuals[:, :1]), residuals[:, :-1]], axis=1)
  accumulated = (grads + previous).sum(axis=0)
  kept = residuals.sum(axis=0) + num_workers * np.asarray(updates, np.float64)[0]
  np.testing.assert_allclose(kept, accumulated, rtol=1e-5, atol=1e-4)
  assert np.asarray(states.stats.overflow).max() > 0


# ---------------------------------------------------------- density, overflow


@pytest.mark.parametrize("num_workers", [4, 16])
def test_positional_profile_sends_k_with_little_overflow(num_workers):
  num_elements, density = 70_000, 0.01
  stats = run_stats(density, positional_stream(num_workers, 50, num_elements, seed=num_workers))
  error, overflow = sent_density_error(stats, int(density * num_elements))
  assert error <= 0.03 and overflow <= 0.01, (error, overflow)


def test_heterogeneous_workers_send_k_within_five_percent():
  num_elements, density = 70_000, 0.01
  grads = positional_stream(8, 70, num_elements, seed=3, worker_scale=0.25)
  stats = run_stats(density, grads)
  error, _ = sent_density_error(stats, int(density * num_elements))
  assert error <= 0.05, error


def test_a_workers_gradient_spike_overflows_for_two_steps_not_a_sweep():
  """One worker's batch gives a 10x gradient once; error feedback keeps it.

  That worker then selects about ten times its share in every partition it
  visits for one sweep (``n`` steps). The partitions were cut before the
  spike, so its first step overflows; its scale rises fast enough that the
  partitions from the third step on are cut for it (a scale that rose by 5 %
  of the surprise per step, as it falls, overflowed about 0.3 k at every
  step of the sweep).
  """
  num_workers, num_elements, density, spike = 8, 70_000, 0.01, 30
  grads = positional_stream(num_workers, 70, num_elements, seed=5)
  grads[3, spike] *= 10
  stats = run_stats(density, grads)
  overflow = stats.overflow / int(density * num_elements)
  assert overflow[spike] > 0.2, "the spike overflowed the buffer it was cut for"
  assert overflow[spike + 1 : spike + num_workers].sum() <= 0.5, overflow[spike:]
  assert overflow[spike + 3 : spike + num_workers].sum() <= 0.1, overflow[spike:]


def test_the_reference_rule_stalls_where_the_balanced_one_does_not():
  """The case the balanced partitioner exists for: the published rule overflows."""
  num_elements, density = 40_000, 0.01
  grads = positional_stream(8, 60, num_elements, seed=4)
  target = int(density * num_elements)
  balanced = run_stats(exdyna_jax.exdyna(density, capacity_factor=1.5), grads)
  published = run_stats(
      exdyna_jax.exdyna(density, capacity_factor=1.5, partitioner="reference", num_blocks=256),
      grads,
  )
  assert np.median(balanced.imbalance[20:]) < 1.3
  assert np.median(published.imbalance[20:]) > 2 * np.median(balanced.imbalance[20:]) - 1
  assert sent_density_error(published, target)[0] > 3 * sent_density_error(balanced, target)[0]


# ------------------------------------------------------- the controller holds


def scaled_stream(scales, num_workers=4, num_elements=20_000, seed=5):
  noise = np.random.default_rng(seed).standard_normal((num_workers, len(scales), num_elements))
  return (noise * np.asarray(scales)[None, :, None]).astype(np.float32)


def steps_to_settle(stats, target, since, run=5, tolerance=0.05):
  """Steps after ``since`` until ``run`` steps in a row transmit within ``tolerance`` of ``k``."""
  inside = np.abs(stats.transmitted[since:] / target - 1) <= tolerance
  for delay in range(len(inside) - run + 1):
    if inside[delay : delay + run].all():
      return delay
  return None


def test_a_long_all_zero_phase_keeps_the_threshold_and_recovers_within_ten_steps():
  density, steps = 0.05, 150
  scales = np.ones(steps)
  scales[10:110] = 0.0  # long enough to flush every residual, then nothing passes
  stats = run_stats(density, scaled_stream(scales))
  assert np.all(np.isfinite(stats.threshold)) and np.all(stats.threshold > 0)
  assert stats.transmitted[105] <= 4, "the residuals were flushed: only fallback indices"
  assert steps_to_settle(stats, int(density * 20_000), 110) <= 10


@pytest.mark.parametrize("jump", [1e6, 1e-6, 1e30, 1e-30])
@pytest.mark.parametrize("flushed", [False, True], ids=["steady", "after_a_flush"])
def test_a_jump_of_the_gradient_scale_is_absorbed_within_ten_steps(jump, flushed):
  """From a steady state, or after a zero phase has emptied the residuals.

  A jump down from a steady state keeps sending the residuals' mass at the
  old scale for a long time; after a flush only the new gradients are left.
  """
  density, steps, since = 0.05, 150, 40
  scales = np.where(np.arange(steps) < since, 1.0, jump)
  if flushed:
    since = 110
    scales[10:since] = 0.0
  stats = run_stats(density, scaled_stream(scales))
  target = int(density * 20_000)
  assert np.all(np.isfinite(stats.threshold)) and np.all(stats.threshold > 0)
  assert steps_to_settle(stats, target, since) <= 10
  assert np.median(np.abs(stats.transmitted[-20:] / target - 1)) <= 0.03


# ------------------------------------------------------------- blocks, errors


def test_the_readme_call_works_on_a_small_model():
  """``exdyna(density=0.01)`` on a 19,210-parameter MLP: default blocks fit it."""
  params = {"w1": jnp.zeros((64, 256)), "b1": jnp.zeros(256), "w2": jnp.zeros((256, 10)),
            "b2": jnp.zeros(10)}
  num_elements = sum(x.size for x in jax.tree.leaves(params))
  assert num_elements == 19_210
  grads = jax.tree.map(lambda x: jnp.ones((8, 3, *x.shape)), params)
  _, states, _ = harness.run_vmap(exdyna_jax.exdyna(density=0.01), params, grads)
  assert int(np.asarray(states.stats.step)[0, -1]) == 3


def test_blocks_have_no_large_remainder():
  geometry = exdyna_jax.methods.exdyna._balance.balanced_geometry(85_002, 8)  # the demo's MLP
  last = geometry.num_elements - (geometry.num_blocks - 1) * geometry.block_size
  assert 0 < last <= geometry.block_size
  assert geometry.num_blocks * geometry.block_size - geometry.num_elements < geometry.block_size


def _init(tx, num_elements, num_workers=8):
  params = jnp.zeros(num_elements)
  return jax.vmap(lambda _: tx.init(params), axis_name="data", axis_size=num_workers)(
      jnp.arange(num_workers)
  )


@pytest.mark.parametrize("num_blocks", [3, 50_000])
def test_impossible_block_counts_name_a_value_that_works(num_blocks):
  num_elements = 1_000
  with pytest.raises(ValueError, match=r"Pass num_blocks between") as error:
    _init(exdyna_jax.exdyna(0.1, num_blocks=num_blocks), num_elements)
  low, high = map(int, re.search(r"between (\d+) and (\d+)", str(error.value)).groups())
  for advised in (low, high):
    _init(exdyna_jax.exdyna(0.1, num_blocks=advised), num_elements)


def test_numpy_integer_block_counts_are_accepted():
  _init(exdyna_jax.exdyna(0.1, num_blocks=np.int64(64)), 1_000)


def test_unknown_partitioner_is_rejected():
  with pytest.raises(ValueError, match=r"'balanced'.*'reference'"):
    exdyna_jax.exdyna(0.01, partitioner="greedy")
  with pytest.raises(TypeError, match=r"'balanced' or 'reference', got 3"):
    exdyna_jax.exdyna(0.01, partitioner=3)
