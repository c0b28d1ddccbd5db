"""MiCRO, Top-k, hard threshold, CLT-k and dense against independent NumPy models."""

from __future__ import annotations

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import exdyna_jax
from tests.harness import (
    AXIS,
    compiler_options,
    run_pmap,
    run_shard_map,
    run_vmap,
    to_numpy,
    unflatten_like,
)
from tests.models import peers_model

NUM_WORKERS = 4
NUM_STEPS = 12
DENSITY = 0.05
SHAPES = {"b": (64,), "w": (32, 65)}  # leaves in this (sorted-key) order
NUM_ELEMENTS = sum(math.prod(shape) for shape in SHAPES.values())  # 2144
K = math.floor(DENSITY * NUM_ELEMENTS)
PARAMS = {name: jnp.zeros(shape, jnp.float32) for name, shape in SHAPES.items()}


def flat_gradients(seed: int = 0) -> np.ndarray:
  """``[n, T, N]`` heavy-tailed gradients, uneven along the vector, disagreeing
  between workers.

  The last quarter is nearly silent, so MiCRO's partition 3 sends its
  fallback index; the scale decays by 0.7 per step so that MiCRO's selected
  count crosses all three bands of the published threshold rule.
  """
  rng = np.random.default_rng(seed)
  position = np.arange(NUM_ELEMENTS) / NUM_ELEMENTS
  scale = 0.006 * np.exp(1.5 * position)
  scale[3 * NUM_ELEMENTS // 4 :] = 1e-6
  noise = rng.standard_t(3, size=(NUM_WORKERS, NUM_STEPS, NUM_ELEMENTS))
  worker_gain = 1.0 + 0.25 * np.arange(NUM_WORKERS)[:, None, None]
  step_gain = 0.7 ** np.arange(NUM_STEPS)[None, :, None]
  return (noise * scale * worker_gain * step_gain).astype(np.float32)


def to_tree(flat: np.ndarray) -> dict[str, np.ndarray]:
  """Splits the last axis of ``flat`` into the leaves of `SHAPES`."""
  return unflatten_like(flat, PARAMS)


def to_flat(tree) -> np.ndarray:
  leaves = [np.asarray(leaf) for leaf in jax.tree.leaves(tree)]
  lead = leaves[0].shape[:2]
  return np.concatenate([leaf.reshape(*lead, -1) for leaf in leaves], axis=-1)


def capacity_of(capacity_factor: float) -> int:
  return math.ceil(capacity_factor * K / NUM_WORKERS)


CASES = {
    "micro": (
        lambda: exdyna_jax.micro(DENSITY, controller="reference", capacity_factor=8.0),
        lambda g: peers_model.micro(g, DENSITY, capacity_of(8.0)),
    ),
    "micro_overflow": (
        lambda: exdyna_jax.micro(DENSITY, controller="reference", capacity_factor=0.5),
        lambda g: peers_model.micro(g, DENSITY, capacity_of(0.5)),
    ),
    "topk": (
        lambda: exdyna_jax.topk(DENSITY),
        lambda g: peers_model.topk(g, DENSITY),
    ),
    "hard_threshold": (
        lambda: exdyna_jax.hard_threshold(DENSITY),
        lambda g: peers_model.hard_threshold(
            g, peers_model.initial_threshold(K), math.ceil(2.0 * K)
        ),
    ),
    "hard_threshold_fixed": (
        lambda: exdyna_jax.hard_threshold(threshold=0.03, capacity=40),
        lambda g: peers_model.hard_threshold(g, 0.03, 40),
    ),
    "cltk": (
        lambda: exdyna_jax.cltk(DENSITY),
        lambda g: peers_model.cltk(g, DENSITY),
    ),
    "dense": (
        lambda: exdyna_jax.dense(),
        peers_model.dense,
    ),
}
# MiCRO's residual enters a lax.scan carry as invariant zeros: check_vma=True
# is exercised on the error-feedback methods only.
RUNNERS = {
    "vmap": run_vmap,
    "pmap": run_pmap,
    "shard_map": functools.partial(run_shard_map, check_vma=False),
    "shard_map_vma": functools.partial(run_shard_map, check_vma=True),
}
RUNS = [(case, "vmap") for case in CASES] + [
    ("micro", "pmap"),
    ("micro", "shard_map"),
    ("topk", "pmap"),
    ("topk", "shard_map_vma"),
    ("hard_threshold", "pmap"),
    ("hard_threshold", "shard_map_vma"),
    ("cltk", "pmap"),
    ("cltk", "shard_map_vma"),
    ("dense", "pmap"),
    ("dense", "shard_map_vma"),
]


@functools.cache
def run_case(case: str, runner: str):
  """``(flat grads, flat updates [n, T, N], per-step states, model trace)``."""
  make_tx, model = CASES[case]
  grads = flat_gradients()
  updates, states, _ = RUNNERS[runner](make_tx(), PARAMS, to_tree(grads))
  return grads, to_flat(updates), to_numpy(states), model(grads)


@pytest.mark.parametrize(("case", "runner"), RUNS)
def test_matches_model(case, runner):
  assert_matches_model(*run_case(case, runner))


def test_steered_topk_matches_the_model_at_its_own_thresholds():
  """``topk(exact=False)``: each worker sends the lowest ``k`` indices past a
  threshold of its own, and the union is summed as for the exact method."""
  grads = flat_gradients()
  updates, states, _ = run_shard_map(exdyna_jax.topk(DENSITY, exact=False), PARAMS,
                                     to_tree(grads), check_vma=True)
  states = to_numpy(states)
  thresholds = states.threshold.T  # [T, n]: each worker's own, after each step
  assert np.all(thresholds.max(axis=1) > thresholds.min(axis=1))  # the workers differ
  trace = peers_model.steered_topk(grads, K, thresholds)
  assert_matches_model(grads, to_flat(updates), states, trace)
  # Steered to k while the scale falls 30 % a step: after the first steps each
  # worker's count is within 15 % of k, and within 3 % at the median.
  np.testing.assert_allclose(trace.workloads[3:] / K, 1.0, atol=0.15)
  assert np.median(np.abs(trace.workloads[3:] / K - 1)) < 0.03
  assert np.any(trace.overflow > 0) and np.any(trace.selected < NUM_WORKERS * K)


def assert_matches_model(grads, updates, states, trace):
  stats = states.stats

  # One aggregated update, identical on every worker, equal to the model's.
  for w in range(1, NUM_WORKERS):
    np.testing.assert_array_equal(updates[w], updates[0])
  np.testing.assert_array_equal(updates[0] != 0, trace.updates != 0)
  np.testing.assert_allclose(updates[0], trace.updates, rtol=1e-5, atol=1e-9)

  # Residuals are exact (no cross-worker arithmetic reaches them).
  residuals = getattr(states, "residual", np.zeros_like(grads))
  np.testing.assert_array_equal(residuals, trace.residuals)

  # Conservation: sum_w m_w(new) + n * update == sum_w a_w.
  previous = np.concatenate([np.zeros_like(residuals[:, :1]), residuals[:, :-1]], axis=1)
  accumulated = np.sum(grads + previous, axis=0)
  kept = np.sum(residuals, axis=0) + NUM_WORKERS * updates[0]
  np.testing.assert_allclose(kept, accumulated, rtol=1e-5, atol=1e-6)

  # Statistics, the same on every worker.
  for w in range(NUM_WORKERS):
    np.testing.assert_array_equal(stats.step[w], np.arange(1, NUM_STEPS + 1))
    np.testing.assert_array_equal(stats.threshold[w], trace.threshold)
    np.testing.assert_array_equal(stats.selected[w], trace.selected)
    np.testing.assert_array_equal(stats.transmitted[w], trace.transmitted)
    np.testing.assert_array_equal(stats.overflow[w], trace.overflow)
    np.testing.assert_array_equal(stats.workloads[w], trace.workloads)


def test_models_exercise_the_rules():
  """The data reach the branches the model comparisons are meant to cover."""
  grads = flat_gradients()
  micro = peers_model.micro(grads, DENSITY, capacity_of(8.0))
  factors = {
      float(peers_model.reference_factor(int(selected), K)) for selected in micro.selected[:-1]
  }
  assert len(factors) == 3, factors  # up, creep and down all happen
  assert np.all(micro.workloads[:, 3] == 1)  # the silent partition sends its fallback
  assert np.all(micro.overflow == 0)
  assert np.any(peers_model.micro(grads, DENSITY, capacity_of(0.5)).overflow > 0)
  assert np.any(peers_model.hard_threshold(grads, 0.03, 40).overflow > 0)


def test_topk_build_up():
  _, _, states, _ = run_case("topk", "vmap")
  stats = states.stats
  assert np.all(stats.selected == NUM_WORKERS * K)
  assert np.all(stats.transmitted > K)
  assert np.all(stats.transmitted <= NUM_WORKERS * K)
  assert np.all(stats.overflow == 0)
  np.testing.assert_array_equal(stats.workloads, K)


def test_cltk_leader_rotates():
  _, _, states, _ = run_case("cltk", "vmap")
  leaders = np.argmax(states.stats.workloads[0], axis=1)
  np.testing.assert_array_equal(leaders, np.arange(NUM_STEPS) % NUM_WORKERS)
  np.testing.assert_array_equal(states.stats.transmitted[0], K)


def _per_worker_init(tx, params, num_workers):
  return jax.vmap(lambda _: tx.init(params), axis_name=AXIS, axis_size=num_workers)(
      jnp.arange(num_workers)
  )


@pytest.mark.parametrize("case", ["micro", "topk", "hard_threshold", "cltk", "dense"])
def test_no_retracing(case):
  tx = CASES[case][0]()
  params = {"w": jnp.zeros((8, 40))}
  chex.clear_trace_counter()

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(grads, state):
    return jax.vmap(lambda g, s: tx.update(g, s, params), axis_name=AXIS)(grads, state)

  state = _per_worker_init(tx, params, NUM_WORKERS)
  for seed in range(3):
    grads = {"w": jax.random.normal(jax.random.key(seed), (NUM_WORKERS, 8, 40))}
    _, state = step(grads, state)
  assert int(exdyna_jax.get_stats(state).step[0]) == 3


def test_micro_partitions_are_elements():
  state = _per_worker_init(exdyna_jax.micro(0.5), {"w": jnp.zeros((10,))}, NUM_WORKERS)
  np.testing.assert_array_equal(state.stats.partition_sizes[0], [3, 3, 2, 2])
  np.testing.assert_array_equal(state.stats.partition_starts[0], [0, 3, 6, 8])
  with pytest.raises(ValueError, match="fewer than the 4 workers"):
    _per_worker_init(exdyna_jax.micro(0.5), {"w": jnp.zeros((3,))}, NUM_WORKERS)


def test_hard_threshold_options():
  with pytest.raises(ValueError, match="exactly one of density"):
    exdyna_jax.hard_threshold()
  with pytest.raises(ValueError, match="exactly one of density"):
    exdyna_jax.hard_threshold(0.01, threshold=0.1)
  with pytest.raises(ValueError, match="pass capacity="):
    exdyna_jax.hard_threshold(threshold=0.1)
  with pytest.raises(ValueError, match="positive and finite"):
    exdyna_jax.hard_threshold(threshold=-1.0, capacity=8)
  with pytest.raises(ValueError, match="capacity must be a positive int"):
    exdyna_jax.hard_threshold(0.01, capacity=0)
  state = _per_worker_init(
      exdyna_jax.hard_threshold(threshold=0.25, capacity=8), {"w": jnp.zeros((64,))}, 2
  )
  np.testing.assert_array_equal(state.stats.threshold, np.float32(0.25))


def _imbalance_trace(tx, num_elements, num_steps, num_workers):
  """``stats.imbalance`` of every step, gradients drawn inside the scan.

  The gradient's scale grows as ``exp(1.5 x)`` along the flat vector, so the
  load of a static quarter differs by ~20x between the ends.
  """
  params = jnp.zeros((num_elements,), jnp.float32)
  scale = 0.01 * jnp.exp(1.5 * jnp.arange(num_elements, dtype=jnp.float32) / num_elements)

  def worker(key):
    def step(state, t):
      grads = jax.random.normal(jax.random.fold_in(key, t), (num_elements,)) * scale
      _, state = tx.update(grads, state, params)
      return state, state.stats.imbalance

    return jax.lax.scan(step, tx.init(params), jnp.arange(num_steps))[1]

  keys = jax.random.split(jax.random.key(0), num_workers)
  run = jax.jit(jax.vmap(worker, axis_name=AXIS, axis_size=num_workers),
                compiler_options=compiler_options(num_workers * num_steps * num_elements))
  return np.asarray(run(keys)[0])


def test_micro_stays_imbalanced_where_exdyna_rebalances():
  num_elements, num_steps, num_workers = 16384, 160, 4
  micro = _imbalance_trace(exdyna_jax.micro(0.01), num_elements, num_steps, num_workers)
  exdyna = _imbalance_trace(
      exdyna_jax.exdyna(0.01, num_blocks=256), num_elements, num_steps, num_workers
  )
  assert np.median(micro[-60:]) > 2.0
  assert np.median(exdyna[-60:]) < 1.2
  # Re-cut from the measured workload every step, it is balanced from the start.
  assert np.median(exdyna[:50]) < 1.5 < np.median(micro[:50])


def test_steered_topk_follows_a_schedule_and_checks_exact():
  """A dense level sends the mean; the sparse one then steers from ``1 / (2 sqrt(k))``."""
  tx = exdyna_jax.topk({0: 1.0, 2: DENSITY}, exact=False)
  grads = flat_gradients()[:, :4]
  updates, states, _ = run_vmap(tx, PARAMS, to_tree(grads))
  updates, states = to_flat(updates), to_numpy(states)
  np.testing.assert_allclose(updates[0, :2], grads[:, :2].mean(axis=0), rtol=1e-5, atol=1e-9)
  np.testing.assert_array_equal(states.threshold[:, :2], peers_model.initial_threshold(K))
  assert np.all(states.stats.transmitted[0, 2:] <= NUM_WORKERS * K)
  with pytest.raises(TypeError, match="exact must be True or False"):
    exdyna_jax.topk(DENSITY, exact="no")
