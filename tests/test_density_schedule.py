"""A density schedule ``{first_step: density}``: each level is the method at that density.

The specification: at a step of a sparse level the update and the state are
exactly those of the method built with that level's density, run on the
state the schedule has reached; at a dense level (1.0) the update is the
mean of every worker's accumulated gradient ``g + m`` and every residual is
cleared; the bytes sent each step are the current level's; nothing is lost
across levels; one compiled program serves every level.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import P

import exdyna_jax
from tests import harness

N, NUM_WORKERS, STEPS = 2048, 4, 8
SCHEDULE = {0: 1.0, 2: 0.05, 5: 0.02}
SCHEDULED = harness.SPARSIFYING


def make(name, density):
  options = {"num_blocks": 32} if name == "exdyna" else {}
  return exdyna_jax.get_sparsifier(name, density=density, **options)


def gradients(seed=0):
  rng = np.random.default_rng(seed)
  return rng.standard_t(3, size=(NUM_WORKERS, STEPS, N)).astype(np.float32)


def run(tx, grads, state=None):
  """Steps ``grads [n, T, N]`` from ``state`` (or init): ``(updates [T, N], states [T], final)``."""
  params = jnp.zeros(N)

  def per_worker(grads, state):
    state = tx.init(params) if state is None else state

    def step(state, g):
      update, state = tx.update(g, state, params)
      return state, (update, state)

    final, (updates, states) = jax.lax.scan(step, state, grads)
    return updates, states, final

  mapped = jax.vmap(per_worker, axis_name=harness.AXIS, axis_size=grads.shape[0])
  updates, states, final = jax.jit(mapped)(grads, state)
  return np.asarray(updates[0]), states, final


def level_at(step):
  return max(first for first in SCHEDULE if first <= step)


@pytest.mark.parametrize("name", SCHEDULED)
def test_each_step_is_its_level(name):
  grads = gradients()
  updates, states, final = run(make(name, SCHEDULE), grads)
  residuals = np.asarray(states.residual)  # [n, T, N]

  # Dense steps: the mean of g + m, every residual cleared (from zero: m = 0, then 0).
  for t in (0, 1):
    np.testing.assert_allclose(updates[t], grads[:, t].mean(0), rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(residuals[:, t], 0.0)

  # Sparse steps: the method at the level's density, from the state reached so far.
  state = jax.tree.map(lambda leaf: leaf[:, 1], states)
  for first, last in ((2, 5), (5, STEPS)):
    expected, _, state_after = run(make(name, SCHEDULE[first]), grads[:, first:last], state)
    np.testing.assert_allclose(updates[first:last], expected, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(residuals[:, last - 1], state_after.residual, atol=1e-6)
    state = jax.tree.map(lambda leaf, last=last: leaf[:, last - 1], states)

  # What the schedule sent, and kept, adds up to what it was given.
  given = grads.astype(np.float64).sum((0, 1))
  sent = NUM_WORKERS * updates.astype(np.float64).sum(0)
  np.testing.assert_allclose(np.asarray(final.residual, np.float64).sum(0) + sent, given, atol=1e-4)


@pytest.mark.parametrize("name", ["exdyna", "topk"])  # the other two share their steps
def test_bytes_and_counts_follow_the_level(name):
  grads = gradients(1)
  _, states, _ = run(make(name, SCHEDULE), grads)
  stats = exdyna_jax.get_stats(states)
  np.testing.assert_array_equal(stats.step[0], np.arange(1, STEPS + 1))
  unscheduled = {
      density: int(exdyna_jax.get_stats(run(make(name, density), grads[:, :1])[1]).bytes_sent[0, 0])
      for density in (0.05, 0.02)
  }
  dense = int(exdyna_jax.get_stats(run(exdyna_jax.dense(), grads[:, :1])[1]).bytes_sent[0, 0])
  for t in range(STEPS):
    density = SCHEDULE[level_at(t)]
    expected = dense if density == 1.0 else unscheduled[density]
    assert int(stats.bytes_sent[0, t]) == expected, t
  np.testing.assert_array_equal(stats.transmitted[0, :2], N)
  assert (stats.transmitted[0, 5:] <= 2 * 0.02 * N * NUM_WORKERS).all()


def test_one_program_serves_every_level():
  tx = make("exdyna", SCHEDULE)
  params = jnp.zeros(N)
  traces = []

  def step(state, g):
    traces.append(1)
    return tx.update(g, state, params)[1]

  step = jax.jit(jax.vmap(step, axis_name=harness.AXIS))
  state = jax.vmap(lambda _: tx.init(params), axis_name=harness.AXIS)(jnp.arange(NUM_WORKERS))
  for t in range(STEPS):
    state = step(state, gradients()[:, t])
  assert len(traces) == 1
  assert int(exdyna_jax.get_stats(state).step[0]) == STEPS


def test_a_skipped_step_at_a_dense_level_keeps_the_residual():
  grads = gradients(2)
  grads[1, 3, 7] = np.nan  # step 3: dense in this schedule
  schedule = {0: 0.05, 3: 1.0, 5: 0.05}
  updates, states, _ = run(make("topk", schedule), grads)
  residuals = np.asarray(states.residual)
  np.testing.assert_array_equal(updates[3], 0.0)
  np.testing.assert_array_equal(residuals[:, 3], residuals[:, 2])
  assert np.abs(residuals[:, 2]).max() > 0  # there was something to keep
  np.testing.assert_array_equal(residuals[:, 4], 0.0)  # the next step is the dense one
  np.testing.assert_array_equal(exdyna_jax.get_stats(states).skipped_steps[0, -1], 1)


@pytest.mark.parametrize(
    ("density", "error", "match"),
    [
        ({5: 0.01}, ValueError, "needs a density for step 0"),
        ({0: 0.1, 2.5: 0.01}, TypeError, "first steps"),
        ({0: 1.0, 10: 1.0}, ValueError, r"exdyna_jax.dense\(\)"),
        ({0: 0.1, 10: 0.0}, ValueError, r"density must be in \(0, 1\]"),
        ({0: 0.1, 2**31: 0.01}, ValueError, r"in \[0, 2147483647\] \(the step counter is int32\)"),
        ({-5: 0.1, 0: 0.01}, ValueError, r"in \[0, 2147483647\]"),
    ],
)
def test_bad_schedules_say_what_is_expected(density, error, match):
  with pytest.raises(error, match=match):
    exdyna_jax.exdyna(density)


def test_dgc_warmup_ends_at_the_density_and_trains():
  schedule = exdyna_jax.dgc_warmup(0.01, steps_per_level=2, start=1.0)
  assert schedule == {0: 1.0, 2: 0.25, 4: 0.0625, 6: 0.015625, 8: 0.01}
  tx = optax.chain(make("exdyna", schedule), optax.sgd(0.1))
  _, states, _ = run(tx, np.concatenate([gradients(3)] * 2, axis=1))
  stats = exdyna_jax.get_stats(states)
  assert int(stats.transmitted[0, 0]) == N
  assert 0.5 * 0.01 * N <= int(stats.transmitted[0, -1]) <= 1.1 * 0.01 * N + 1
  with pytest.raises(ValueError, match="factor must be above 1"):
    exdyna_jax.dgc_warmup(0.01, steps_per_level=2, factor=1.0)


@pytest.mark.parametrize(
    "runner",
    [
        lambda tx, p, g: harness.run_shard_map(tx, p, g, check_vma=True),
        harness.run_pmap,
    ],
    ids=["shard_map_varying_types", "pmap"],
)
def test_real_devices_run_the_same_schedule(runner):
  """One branch per level under jax.shard_map (check_vma=True) and jax.pmap, as under vmap."""
  tx = make("topk", {0: 0.05, 3: 1.0, 5: 0.02})
  grads = gradients(4)
  expected, _, _ = run(tx, grads)
  updates = np.asarray(runner(tx, jnp.zeros(N), grads)[0])
  np.testing.assert_allclose(updates[0], expected, rtol=1e-6, atol=1e-7)
  np.testing.assert_array_equal(updates, np.broadcast_to(updates[:1], updates.shape))


@pytest.mark.parametrize("name", SCHEDULED)
def test_a_state_kept_between_calls_runs_the_schedule_under_varying_types(name):
  """The state leaves one jitted ``shard_map(check_vma=True)`` step and enters the next
  sharded (every field varying): a dense level's fields and a sparse level's agree."""
  tx, grads = make(name, SCHEDULE), gradients(4)
  expected, _, _ = run(tx, grads)
  mesh, params = harness.mesh_of(NUM_WORKERS), jnp.zeros(N)

  def per_device(fn):
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P(harness.AXIS),
                                 out_specs=P(harness.AXIS), check_vma=True))

  state = per_device(lambda _: jax.tree.map(lambda x: x[None], tx.init(params)))(
      jnp.zeros(NUM_WORKERS))
  step = per_device(lambda g, state: jax.tree.map(lambda x: x[None], tx.update(
      g[0], jax.tree.map(lambda x: x[0], state), params)))
  for t in range(STEPS):
    update, state = step(grads[:, t], state)
    np.testing.assert_allclose(np.asarray(update), np.broadcast_to(expected[t], update.shape),
                               rtol=1e-6, atol=1e-7)


def test_under_vmap_a_step_runs_only_its_level():
  """The step count is batched under ``vmap``; the schedule still picks one branch (a
  batched ``lax.switch`` index would become selects running every level's step)."""
  tx, params = make("topk", SCHEDULE), jnp.zeros(N)
  step = jax.vmap(lambda g, state: tx.update(g, state, params), axis_name=harness.AXIS)
  states = jax.vmap(lambda _: tx.init(params), axis_name=harness.AXIS)(jnp.arange(NUM_WORKERS))
  program = jax.make_jaxpr(step)(gradients()[:, 0], states)
  level_switches = [eqn for eqn in harness.equations(program.jaxpr)
                    if eqn.primitive.name == "cond" and len(eqn.params["branches"]) == 3]
  assert len(level_switches) == 1


@pytest.mark.parametrize("name", SCHEDULED)
def test_a_density_of_one_is_the_dense_mean_in_every_method(name):
  grads = gradients(seed=3) * np.linspace(0.01, 3.0, N, dtype=np.float32)  # uneven magnitudes
  tx = exdyna_jax.get_sparsifier(name, density=1.0)
  updates, states, _ = run(tx, grads)
  np.testing.assert_allclose(updates, grads.mean(axis=0), rtol=0, atol=0)
  stats = optax.tree.get(states, "stats")
  np.testing.assert_array_equal(stats.transmitted[0], N)
  np.testing.assert_array_equal(stats.overflow[0], 0)
