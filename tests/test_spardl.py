"""SparDL: step-by-step agreement with the NumPy model, conservation, plumbing."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import P

import exdyna_jax
from exdyna_jax.methods._spardl import SparDLState, spardl
from tests.harness import AXIS, mesh_of, run_pmap, run_shard_map, run_vmap, to_numpy
from tests.models.spardl_model import SparDLModel

WORKER_COUNTS = (2, 3, 5, 6, 8)
SCHEDULES = ("log", "ring")
STEPS = 12
SHAPES = {"a": (7, 9), "b": (40,)}  # N = 103: not a multiple of any n above but 1
NUM_ELEMENTS = 103
PARAMS = {name: jnp.zeros(shape, jnp.float32) for name, shape in SHAPES.items()}


def _split(flat: np.ndarray) -> dict:
  """``[..., N]`` -> the PARAMS tree with the same leading axes."""
  lead = flat.shape[:-1]
  return {"a": flat[..., :63].reshape(*lead, 7, 9), "b": flat[..., 63:]}


def _join(tree: dict) -> np.ndarray:
  lead = tree["b"].shape[:-1]
  return np.concatenate([np.asarray(tree["a"]).reshape(*lead, 63), np.asarray(tree["b"])], -1)


def _gradients(n: int, kind: str, seed: int) -> np.ndarray:
  rng = np.random.default_rng(seed)
  shape = (n, STEPS, NUM_ELEMENTS)
  if kind == "heavy":  # uneven, heavy-tailed, with a drifting hot region
    g = rng.standard_t(2, size=shape) * np.exp(rng.normal(0, 1, size=(n, 1, NUM_ELEMENTS)))
  else:  # "ties": small integers, so magnitudes tie everywhere and sums are exact
    g = rng.integers(-2, 3, size=shape)
  return g.astype(np.float32)


@functools.cache
def _run(n: int, schedule: str, density: float = 0.1, kind: str = "heavy",
         value_dtype: str = "float32"):
  """Runs spardl under run_vmap; returns (grads, updates, states) as NumPy."""
  grads = _gradients(n, kind, seed=1000 * n + len(schedule))
  tx = spardl(density, schedule=schedule, value_dtype=value_dtype)
  updates, states, _ = to_numpy(run_vmap(tx, PARAMS, _split(grads)))
  return grads, _join(updates), states


def _assert_matches_model(n, schedule, density, kind, value_dtype="float32"):
  grads, updates, states = _run(n, schedule, density, kind, value_dtype)
  model = SparDLModel(n, NUM_ELEMENTS, density, schedule, jnp.dtype(value_dtype))
  for t in range(STEPS):
    want_update, want_residual = model.step(grads[:, t])
    # Residuals bit for bit; the update within 1 ulp (XLA divides by n as a
    # product with a rounded 1/n, NumPy divides exactly).
    np.testing.assert_array_equal(states.residual[:, t], want_residual, err_msg=f"step {t}")
    for w in range(n):
      np.testing.assert_allclose(
          updates[w, t], want_update, rtol=2.0**-23, atol=0, err_msg=f"step {t}, worker {w}"
      )


def test_lax_top_k_breaks_ties_towards_the_lower_index():
  _, indices = jax.lax.top_k(jnp.array([[1.0, 3.0, 3.0, 0.0, 3.0], [0.0, 0.0, 2.0, 2.0, 0.0]]), 3)
  np.testing.assert_array_equal(indices, [[1, 2, 4], [2, 3, 0]])


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("n", (1, *WORKER_COUNTS))
def test_matches_numpy_model_step_by_step(n, schedule):
  _assert_matches_model(n, schedule, 0.1, "heavy")


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("n", (3, 6))
def test_matches_numpy_model_with_ties(n, schedule):
  _assert_matches_model(n, schedule, 0.2, "ties")


@pytest.mark.parametrize("value_dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize(("n", "schedule"), [(3, "ring"), (6, "log")])
def test_a_narrow_wire_matches_the_model_and_halves_the_value_bytes(n, schedule, value_dtype):
  """Every message carries its values rounded; the sender keeps what rounding lost."""
  _assert_matches_model(n, schedule, 0.1, "heavy", value_dtype)
  _, _, narrow = _run(n, schedule, 0.1, "heavy", value_dtype)
  _, _, wide = _run(n, schedule)
  per_block = max(1, math.floor(0.1 * math.ceil(NUM_ELEMENTS / n)))
  per_list = 4 * per_block + 4 * math.ceil(per_block / 2)  # int32 indices, 2 values a word
  np.testing.assert_array_equal(narrow.rounds.all_gather_bytes.sum(-1), (n - 1) * per_list)
  np.testing.assert_array_equal(narrow.rounds.reduce_scatter_bytes.sum(-1), (n - 1) * per_list)
  saved = 2 * (n - 1) * 4 * (per_block - math.ceil(per_block / 2))  # both phases
  np.testing.assert_array_equal(wide.stats.bytes_sent - narrow.stats.bytes_sent, saved)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("n", WORKER_COUNTS)
def test_conserves_mass_and_agrees_across_workers(n, schedule):
  grads, updates, states = _run(n, schedule)
  zeros = np.zeros((n, 1, NUM_ELEMENTS), np.float32)
  previous = np.concatenate([zeros, states.residual[:, :-1]], 1)
  accumulated = grads + previous
  for t in range(STEPS):
    for w in range(1, n):
      np.testing.assert_array_equal(updates[w, t], updates[0, t])
    lhs = states.residual[:, t].astype(np.float64).sum(0) + n * updates[0, t].astype(np.float64)
    rhs = accumulated[:, t].astype(np.float64).sum(0)
    np.testing.assert_allclose(lhs, rhs, rtol=1e-5, atol=1e-5 * np.abs(rhs).max())


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("n", WORKER_COUNTS)
def test_rounds_and_statistics(n, schedule):
  _, updates, states = _run(n, schedule)
  block = math.ceil(NUM_ELEMENTS / n)
  per_block = max(1, math.floor(0.1 * block))
  rounds = states.rounds
  want_rounds = math.ceil(math.log2(n)) if schedule == "log" else n - 1
  assert (rounds.reduce_scatter_rounds == want_rounds).all()
  assert rounds.reduce_scatter_bytes.shape == (n, STEPS, want_rounds)
  assert (rounds.reduce_scatter_bytes.sum(-1) == (n - 1) * per_block * 8).all()
  assert (rounds.all_gather_rounds == math.ceil(math.log2(n))).all()
  assert (rounds.all_gather_bytes.sum(-1) == (n - 1) * per_block * 8).all()
  if schedule == "log" and n == 6:
    want_bytes = np.array([2, 2, 1]) * per_block * 8
    np.testing.assert_array_equal(rounds.reduce_scatter_bytes[0, 0], want_bytes)

  stats = states.stats
  sizes = np.clip(NUM_ELEMENTS - np.arange(n) * block, 0, block)
  np.testing.assert_array_equal(stats.step[0], np.arange(1, STEPS + 1))
  np.testing.assert_array_equal(stats.partition_starts[0, 0], np.arange(n) * block)
  np.testing.assert_array_equal(stats.partition_sizes[0, 0], sizes)
  np.testing.assert_array_equal(stats.workloads[0, 0], np.minimum(per_block, sizes))
  assert (stats.transmitted == np.minimum(per_block, sizes).sum()).all()
  assert (stats.selected == stats.transmitted).all() and (stats.overflow == 0).all()
  flag_bytes = 2 * (n - 1) * 8 // n  # the non-finite screen's two int32 flags, all-reduced
  assert (stats.bytes_sent == 2 * (n - 1) * per_block * 8 + flag_bytes).all()
  for t in range(STEPS):
    nonzero = np.abs(updates[0, t][updates[0, t] != 0])
    assert stats.threshold[0, t] == pytest.approx(nonzero.min(), rel=1e-6)
  for field in stats:  # statistics are identical on every worker
    assert (field == field[:1]).all()


@pytest.mark.parametrize(("schedule", "n"), [("log", 6), ("log", 8), ("ring", 5)])
def test_one_ppermute_per_round(schedule, n):
  tx = spardl(0.1, schedule=schedule)

  def step(grads):
    grads = jax.tree.map(lambda g: g[0], grads)
    updates, _ = tx.update(grads, tx.init(PARAMS), PARAMS)
    return jax.tree.map(lambda u: u[None], updates)

  grads = _split(np.zeros((n, NUM_ELEMENTS), np.float32))
  body = jax.shard_map(step, mesh=mesh_of(n), in_specs=P(AXIS), out_specs=P(AXIS))
  text = str(jax.make_jaxpr(body)(grads))
  want = math.ceil(math.log2(n)) if schedule == "log" else n - 1
  assert text.count("ppermute[") == want


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_full_density_is_the_exact_mean(schedule):
  n = 5
  grads = _gradients(n, "heavy", seed=7)[:, :3]
  updates, states, _ = to_numpy(run_vmap(spardl(1.0, schedule=schedule), PARAMS, _split(grads)))
  np.testing.assert_allclose(_join(updates)[0], grads.mean(0), rtol=1e-5, atol=1e-5)
  assert (states.residual == 0).all()


def test_chained_with_sgd_under_every_harness():
  n = 4
  grads = _split(_gradients(n, "heavy", seed=3)[:, :4])
  tx = optax.chain(spardl(0.05), optax.sgd(0.1))
  runs = {
      "vmap": run_vmap(tx, PARAMS, grads),
      "pmap": run_pmap(tx, PARAMS, grads),
      "shard_map": run_shard_map(tx, PARAMS, grads),
      "shard_map_vma": run_shard_map(tx, PARAMS, grads, check_vma=True),
  }
  model = SparDLModel(n, NUM_ELEMENTS, 0.05, "log")
  flat_grads = _join(grads)
  want = np.stack([-0.1 * model.step(flat_grads[:, t])[0] for t in range(4)])
  for name, (updates, _, final) in runs.items():
    got = _join(to_numpy(updates))
    for w in range(n):
      np.testing.assert_allclose(got[w], want, rtol=1e-6, atol=0, err_msg=name)
    stats = exdyna_jax.get_stats(final)
    np.testing.assert_array_equal(np.asarray(stats.step), 4, err_msg=name)
    assert isinstance(final[0], SparDLState)


def test_tiny_density_sends_one_pair_per_block():
  n = 3
  _, updates, states = _run(n, "ring", 1e-6)
  assert (states.stats.workloads == 1).all()
  assert ((updates[0] != 0).sum(-1) <= n).all()
  _assert_matches_model(n, "ring", 1e-6, "heavy")


@pytest.mark.parametrize("density", [0.0, -0.1, 1.5])
def test_rejects_bad_density(density):
  with pytest.raises(ValueError, match="density"):
    spardl(density)


def test_rejects_bad_schedule():
  with pytest.raises(ValueError, match=r"'log'.*'ring'"):
    spardl(0.1, schedule="tree")


def test_rejects_unbound_axis():
  with pytest.raises(ValueError, match="not bound"):
    spardl(0.1).init(PARAMS)
  with pytest.raises(ValueError, match="not bound"):
    jax.vmap(spardl(0.1, axis_name="batch").init, axis_name=AXIS, axis_size=2)(
        jax.tree.map(lambda x: jnp.stack([x, x]), PARAMS)
    )


def test_rejects_state_of_another_tree_or_worker_count():
  tx = spardl(0.1)
  state = jax.vmap(lambda _: tx.init(PARAMS), axis_name=AXIS, axis_size=2)(jnp.arange(2))
  other = {"a": jnp.zeros((2, 5))}
  with pytest.raises(ValueError, match="initialized for"):
    jax.vmap(lambda s: tx.update(other, s), axis_name=AXIS, axis_size=2)(state)
  grads = jax.tree.map(lambda x: jnp.stack([x] * 4), PARAMS)
  state4 = jax.tree.map(lambda x: jnp.concatenate([x, x]), state)
  with pytest.raises(ValueError, match="workers"):
    jax.vmap(lambda g, s: tx.update(g, s), axis_name=AXIS, axis_size=4)(grads, state4)


def test_registered():
  assert "spardl" in exdyna_jax.available_sparsifiers()
  assert exdyna_jax.spardl is spardl
  tx = exdyna_jax.get_sparsifier("spardl", density=0.1, schedule="ring")
  state = jax.vmap(lambda _: tx.init(PARAMS), axis_name=AXIS, axis_size=3)(jnp.arange(3))
  assert (state.rounds.reduce_scatter_rounds == 2).all()
