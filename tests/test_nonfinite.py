"""Non-finite gradients: one bad step is skipped by every worker and leaves no trace.

The policy (docs/algorithms.md has none; `exdyna_jax.shell._feedback` states it): if the
gradient ``g`` of any worker holds a NaN or an infinity, every
worker skips the step. The update is zero; residual, threshold, partitions,
workloads and step counter keep their values; ``stats.nonfinite`` counts the
bad elements over all workers and ``stats.skipped_steps`` the skipped steps.
So a run with a bad step equals, from then on, the run without it.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import exdyna_jax
from exdyna_jax.core import _stats
from exdyna_jax.shell import _feedback, _guard
from tests import harness

NUM_WORKERS = 4
SHAPES = {"b": (40,), "w": (24, 40)}  # 1,000 elements
OPTIONS = {"exdyna": {"density": 0.05, "num_blocks": 16}, "dense": {}}
BAD_STEPS = (1, 3)


def params():
  return {name: jnp.zeros(shape) for name, shape in SHAPES.items()}


def clean_gradients(steps: int) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(0)
  return {
      name: rng.standard_t(3, size=(NUM_WORKERS, steps, *shape)).astype(np.float32)
      for name, shape in SHAPES.items()
  }


def with_bad_steps(grads):
  """Step 1: one NaN on worker 1. Step 3: +inf on worker 0 and -inf on worker 3."""
  grads = jax.tree.map(np.copy, grads)
  grads["w"][1, 1, 5, 7] = np.nan
  grads["b"][0, 3, 2] = np.inf
  grads["w"][3, 3, 0, 0] = -np.inf
  return grads


def without_bad_steps(grads):
  """The good steps, padded with repeats of the last one to the same length."""
  num_steps = grads["w"].shape[1]
  keep = [t for t in range(num_steps) if t not in BAD_STEPS]
  keep += [keep[-1]] * (num_steps - len(keep))
  return jax.tree.map(lambda g: g[:, keep], grads)


def make(name):
  return exdyna_jax.get_sparsifier(name, **OPTIONS.get(name, {"density": 0.05}))


@functools.cache
def runs(name):
  """``(bad run, clean run without the bad steps)``, each ``(updates, states)``.

  One compiled program runs both (same shapes), so they can be compared bit for bit.
  """
  run = jax.jit(
      jax.vmap(
          harness._scan_steps(make(name), params()),
          axis_name=harness.AXIS,
          axis_size=NUM_WORKERS,
      )
  )
  grads = clean_gradients(6)
  bad_updates, bad_states, _ = run(with_bad_steps(grads))
  updates, states, _ = run(without_bad_steps(grads))
  return harness.to_numpy((bad_updates, bad_states)), harness.to_numpy((updates, states))


def at_step(tree, t):
  return jax.tree.map(lambda x: x[:, t], tree)


def without_guard_fields(state):
  """The state without the fields the guard itself sets (a skipped step sends its count too)."""
  stats = optax.tree.get(state, "stats")
  return optax.tree.set(
      state,
      stats=stats._replace(nonfinite=None, skipped_steps=None, bytes_sent=None, bytes_total=None,
                           layout=None),
  )


@pytest.mark.parametrize("name", exdyna_jax.available_sparsifiers())
def test_bad_step_is_skipped_by_every_worker_and_changes_no_state(name):
  (updates, states), _ = runs(name)
  for t in BAD_STEPS:
    for leaf in jax.tree.leaves(at_step(updates, t)):
      np.testing.assert_array_equal(leaf, 0)
    before, after = (
        without_guard_fields(at_step(states, t - 1)),
        without_guard_fields(at_step(states, t)),
    )
    jax.tree.map(np.testing.assert_array_equal, after, before)  # residual, threshold, ...
  stats = optax.tree.get(states, "stats")
  np.testing.assert_array_equal(stats.nonfinite, [[0, 1, 0, 2, 0, 0]] * NUM_WORKERS)
  np.testing.assert_array_equal(stats.skipped_steps, [[0, 1, 1, 2, 2, 2]] * NUM_WORKERS)
  np.testing.assert_array_equal(stats.step, [[1, 1, 2, 2, 3, 4]] * NUM_WORKERS)
  # A skipped step's exchange runs too (its results dropped), and on a CPU the
  # screen counts a bad step's elements in one more ring all-reduce of an int32.
  count_bytes = 2 * (NUM_WORKERS - 1) * 4 // NUM_WORKERS
  sent = np.asarray(stats.bytes_sent)
  taken = sent[:, [t for t in range(6) if t not in BAD_STEPS]]
  assert (taken == taken[:, :1]).all()
  assert (sent[:, list(BAD_STEPS)] == taken[:, :1] + count_bytes).all()


@pytest.mark.parametrize("name", exdyna_jax.available_sparsifiers())
def test_run_with_bad_steps_equals_the_run_without_them(name):
  """Nothing of a bad step resurfaces later: not in the residual, not in the update."""
  (bad_updates, bad_states), (updates, states) = runs(name)
  good = [t for t in range(6) if t not in BAD_STEPS]
  for leaf in jax.tree.leaves((bad_updates, bad_states)):
    assert np.isfinite(leaf).all()
  clean = range(len(good))
  jax.tree.map(np.testing.assert_array_equal, at_step(bad_updates, good), at_step(updates, clean))
  jax.tree.map(
      np.testing.assert_array_equal,
      without_guard_fields(at_step(bad_states, good)),
      without_guard_fields(at_step(states, clean)),
  )


def test_a_whole_gradient_of_nan_on_one_worker_is_skipped_too():
  grads = clean_gradients(2)
  grads["w"][2, 0] = np.nan
  grads["b"][2, 0] = np.nan
  updates, states, _ = harness.run_vmap(make("topk"), params(), grads)
  np.testing.assert_array_equal(np.asarray(updates["w"])[:, 0], 0)
  np.testing.assert_array_equal(np.asarray(states.stats.nonfinite)[0], [1000, 0])
  np.testing.assert_array_equal(np.asarray(states.residual)[:, 0], 0)
  assert np.isfinite(np.asarray(states.residual)).all()


def test_skip_is_the_same_under_shard_map_with_varying_types():
  grads = with_bad_steps(clean_gradients(4))
  expected_updates, expected_states, _ = harness.run_vmap(make("exdyna"), params(), grads)
  updates, states, _ = harness.run_shard_map(make("exdyna"), params(), grads, check_vma=True)
  np.testing.assert_array_equal(np.asarray(states.stats.skipped_steps)[:, -1], 2)
  np.testing.assert_array_equal(np.asarray(updates["w"])[:, 1], 0)
  for actual, expected in [
      (updates, expected_updates),
      (states.residual, expected_states.residual),
  ]:
    jax.tree.map(
        lambda a, e: np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-5, atol=1e-6),
        actual,
        expected,
    )


# ------------------------------------------------------- optax.apply_if_finite


def guarded_chain():
  return optax.apply_if_finite(optax.chain(make("exdyna"), optax.sgd(0.1)), 3)


@pytest.mark.parametrize(
    "runner", [harness.run_vmap, functools.partial(harness.run_shard_map, check_vma=False)]
)
def test_apply_if_finite_skips_a_step_that_is_bad_on_every_worker(runner):
  """The inner state, residual, threshold and partitions included, is untouched."""
  grads = clean_gradients(3)
  grads["w"][:, 1, 4, 4] = np.nan
  updates, states, _ = runner(guarded_chain(), params(), grads)
  states = harness.to_numpy(states)
  np.testing.assert_array_equal(np.asarray(updates["w"])[:, 1], 0)
  np.testing.assert_array_equal(states.notfinite_count, [[0, 1, 0]] * NUM_WORKERS)
  inner = states.inner_state[0]
  jax.tree.map(np.testing.assert_array_equal, at_step(inner, 1), at_step(inner, 0))
  assert np.isfinite(inner.residual).all()
  np.testing.assert_array_equal(inner.stats.step, [[1, 1, 2]] * NUM_WORKERS)
  np.testing.assert_array_equal(inner.stats.skipped_steps, 0)  # the sparsifier never saw it


def test_apply_if_finite_decides_per_worker_so_its_counters_disagree():
  """A NaN on one worker only: apply_if_finite rejects the step on that worker
  alone. Updates stay identical (the sparsifier skips on the others), but the
  workers' counters diverge; under shard_map the rejecting worker would also
  leave the others waiting in the collectives. Do not wrap the sparsifier in
  apply_if_finite: it already skips globally."""
  grads = clean_gradients(2)
  grads["w"][1, 1, 4, 4] = np.nan
  updates, states, _ = harness.run_vmap(guarded_chain(), params(), grads)
  np.testing.assert_array_equal(np.asarray(updates["w"])[:, 1], 0)
  np.testing.assert_array_equal(np.asarray(states.notfinite_count)[:, 1], [0, 1, 0, 0])
  skipped = np.asarray(states.inner_state[0].stats.skipped_steps)[:, 1]
  np.testing.assert_array_equal(skipped, [1, 0, 1, 1])


def test_apply_if_finite_around_the_sparsifier_is_rejected_under_varying_types():
  """With shard_map(check_vma=True) JAX refuses apply_if_finite's per-worker branch."""
  grads = clean_gradients(1)
  with pytest.raises(TypeError, match="output types match"):
    harness.run_shard_map(guarded_chain(), params(), grads, check_vma=True)


@pytest.mark.parametrize("size", [0, 1, 1000, 65536, 65537, 3 * 65536 + 5])
def test_nonfinite_elements_are_counted_once_in_leaves_of_any_size(size):
  """Counted chunk by chunk: the last chunk overlaps the one before it and counts nothing twice."""
  rng = np.random.default_rng(size)
  leaf = rng.normal(size=size).astype(np.float32)
  bad = rng.choice(size, size=min(size, 40), replace=False) if size else []
  leaf[bad] = rng.choice([np.nan, np.inf, -np.inf], size=len(bad))
  if size > 65536:  # the elements the shifted last chunk shares with the one before
    leaf[size - 65536:65536 * (size // 65536)] = np.nan
  count = jax.vmap(count_nonfinite, axis_name="data")(leaf[None])
  assert int(count[0]) == int(np.sum(~np.isfinite(leaf)))


def test_a_tree_is_screened_in_one_pass_and_counted_leaf_by_leaf():
  """Bad elements in two of five leaves are all counted. On a GPU the pass
  counts them, with no conditional of its own (a GPU reads a conditional's
  predicate back to the host: the screen's one is the check of a state that
  does not fit); on a CPU, where a count is slower than a sum, the pass
  sums and one more conditional counts where the sum is not finite."""
  rng = np.random.default_rng(0)
  tree = {f"w{i}": rng.normal(size=(3, 100 + i)).astype(np.float32) for i in range(5)}
  tree["w1"][0, :3] = [np.nan, np.inf, -np.inf]
  tree["w4"][2, 7] = np.nan
  batched = jax.tree.map(lambda leaf: leaf[None], tree)
  assert int(jax.vmap(screen, axis_name="data")(batched).nonfinite[0]) == 4
  jaxpr = jax.make_jaxpr(screen, axis_env=[("data", 1)])(tree).jaxpr  # as one worker traces it
  for platform, conditionals in (("cpu", 2), ("cuda", 1)):
    equations = harness.all_equations(jaxpr, platform)
    assert [eqn.primitive.name for eqn in equations].count("cond") == conditionals, platform


def test_finite_gradients_too_large_to_sum_are_counted_and_not_skipped():
  """Their sum overflows, so the screen trips; the count finds nothing bad."""
  huge = {"w": np.full((1, 1000), 3e38, np.float32)}
  assert int(jax.vmap(screen, axis_name="data")(huge).nonfinite[0]) == 0


def count_nonfinite(values):
  """`_guard.count_nonfinite` on one worker of an axis of one."""
  return _guard.count_nonfinite(values, "data")


def screen(values):
  """`_guard.screen` on one worker of an axis of one."""
  stats = _stats.initial_stats(0.0, *_stats.whole_vector(1, 1))  # one worker, no layout
  return _guard.screen(values, stats, 1, "data")


@pytest.mark.parametrize("name", ["dense", "exdyna"])
def test_simulated_workers_keep_the_guards_conditionals(name):
  """Under ``jax.vmap`` the guard's conditionals stay conditionals: their
  predicates are the same on every worker. (A per-worker predicate turns a
  conditional into a select that runs every branch: a count of every element
  and the resized-state callback on every step.) A step has one on a GPU,
  the check of a state that does not fit, and on a CPU also the count of
  bad elements; the step itself is under none."""
  tx = exdyna_jax.get_sparsifier(name, axis_name="data", **OPTIONS[name])
  state = jax.vmap(lambda _: tx.init(params()), axis_name="data")(jnp.arange(NUM_WORKERS))
  grads = jax.tree.map(lambda g: jnp.asarray(g[:, 0]), clean_gradients(1))
  jaxpr = jax.make_jaxpr(jax.vmap(
      lambda g, s: tx.update(g, s, params()), axis_name="data"))(grads, state).jaxpr
  for platform, conditionals in (("cpu", 2), ("cuda", 1)):
    equations = harness.all_equations(jaxpr, platform)
    assert [eqn.primitive.name for eqn in equations].count("cond") == conditionals, platform


@pytest.mark.parametrize("name", ["dense", "exdyna"])
def test_the_guarded_step_has_no_effects_so_jax_dispatches_it_on_its_fast_path(name):
  """The check of a state that does not fit reaches the host through a pure
  callback whose result the stats keep: the update has no effects (a
  ``jax.debug.callback`` is one, and JAX dispatches a program with an effect
  on its slow path, every call), and the check is still in the program."""
  tx = exdyna_jax.get_sparsifier(name, axis_name="data", **OPTIONS[name])
  state = jax.vmap(lambda _: tx.init(params()), axis_name="data")(jnp.arange(NUM_WORKERS))
  grads = jax.tree.map(lambda g: jnp.asarray(g[:, 0]), clean_gradients(1))
  traced = jax.jit(jax.vmap(lambda g, s: tx.update(g, s, params()), axis_name="data")).trace(
      grads, state)
  assert not traced.jaxpr.effects
  assert re.search(r"custom_call @\w*python\w*callback", traced.lower().as_text())


def test_the_check_of_a_state_that_does_not_fit_comes_before_the_step():
  """The pass that forms ``a = g + m`` waits on the check's conditional, so a
  state that does not fit is stopped before the step runs on it. The update
  does not take the check's per-worker result: it stays the same on every
  worker (unbatched under ``vmap``)."""
  tx = exdyna_jax.exdyna(axis_name="data", **OPTIONS["exdyna"])
  state = jax.vmap(lambda _: tx.init(params()), axis_name="data")(jnp.arange(NUM_WORKERS))
  grads = jax.tree.map(lambda g: jnp.asarray(g[:, 0]), clean_gradients(1))
  closed = jax.make_jaxpr(jax.vmap(
      lambda g, s: tx.update(g, s, params()), axis_name="data"))(grads, state)
  checks = [eqn for eqn in closed.jaxpr.eqns
            if eqn.primitive.name == "cond" and "pure_callback" in str(eqn.params["branches"])]
  assert len(checks) == 1
  after_check = set(checks[0].outvars)  # what depends on the check, equation by equation
  for eqn in closed.jaxpr.eqns:
    if any(isinstance(v, jax.extend.core.Var) and v in after_check for v in eqn.invars):
      after_check.update(eqn.outvars)
  residual = closed.jaxpr.outvars[len(jax.tree.leaves(grads))]  # after the update's leaves
  assert residual in after_check
  jax.eval_shape(jax.vmap(lambda g, s: tx.update(g, s, params()), axis_name="data",
                          out_axes=(None, 0)), grads, state)  # raises where the update is batched


def test_a_step_past_int32_bytes_reads_saturated_and_is_totalled_exactly():
  """A step whose own bytes pass ``2**31 - 1`` (a dense all-reduce of 307M
  float32 parameters on 8 workers) reads saturated once the guard adds its
  flags' ``psum`` (the int32 sum wrapped round to a negative count), and the
  run total counts it exactly (it added the saturated figure)."""
  previous = _stats.initial_stats(0.0, *_stats.whole_vector(2, 1))
  step_bytes, flag_bytes = 2**33 + 5, 8  # the flags: a ring all-reduce of 8 bytes over 2

  def guarded(values):
    def step():
      return jnp.zeros(3), state._replace(stats=previous._replace(
          **_stats.bytes_fields(previous, step_bytes)))

    state = _feedback.ErrorFeedbackState(jnp.zeros(1), previous)
    screened = _guard.screen(values, previous, 2, "data")
    return _guard.skip_if_nonfinite(screened, step, (), state)[1].stats

  stats = jax.vmap(guarded, axis_name="data")({"w": np.ones((2, 4), np.float32)})
  np.testing.assert_array_equal(stats.bytes_sent, [2**31 - 1] * 2)
  totals = _stats.read_totals(jax.tree.map(lambda x: x[0], stats))
  assert totals["bytes_sent"] == step_bytes + flag_bytes
