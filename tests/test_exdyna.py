"""ExDyna as users call it: invariants, calling contexts, controllers, errors.

The step-by-step match against the NumPy model of docs/algorithms.md lives in
test_exdyna_reference.py; this file checks what must hold for any input.
"""

from __future__ import annotations

import re
import traceback

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import P

import exdyna_jax
from exdyna_jax.selection import _selection
from exdyna_jax.shell import _guard
from tests import harness

N_WORKERS = 4
BLOCKS = 64


def mixed_params():
  """A multi-leaf tree with mixed shapes (66,650 elements)."""
  return {
      "conv": jnp.zeros((3, 3, 16, 32)),
      "dense": {"w": jnp.zeros((256, 240)), "b": jnp.zeros((240,))},
      "scale": jnp.zeros(()),
      "head": jnp.zeros((10, 50)),
  }


def uneven_grads(seed, params, num_workers, steps, dtype=jnp.float32):
  """Heavy-tailed (Student-t) per-worker gradients whose scale varies strongly by leaf."""
  rng = np.random.default_rng(seed)
  leaves, treedef = jax.tree.flatten(params)
  out = []
  for i, leaf in enumerate(leaves):
    draw = rng.standard_t(3.0, (num_workers, steps, *leaf.shape)) * 10.0 ** (i - 2)
    out.append(jnp.asarray(draw, dtype))
  return jax.tree.unflatten(treedef, out)


def flat(tree, leading=2):
  leaves = jax.tree.leaves(tree)
  return np.concatenate(
      [np.asarray(x, np.float32).reshape(*x.shape[:leading], -1) for x in leaves], axis=-1
  )


@pytest.fixture(scope="module")
def adaptive_run():
  params = mixed_params()
  grads = uneven_grads(0, params, N_WORKERS, 60)
  tx = exdyna_jax.exdyna(0.01, num_blocks=BLOCKS)
  updates, states, final = harness.run_vmap(tx, params, grads)
  return params, grads, updates, states, final


def test_update_keeps_tree_shapes_and_dtypes(adaptive_run):
  _, grads, updates, _, _ = adaptive_run
  chex.assert_trees_all_equal_shapes_and_dtypes(updates, grads)


def test_update_is_identical_on_every_worker(adaptive_run):
  _, _, updates, _, _ = adaptive_run
  for leaf in jax.tree.leaves(updates):
    leaf = np.asarray(leaf)
    np.testing.assert_array_equal(leaf, np.broadcast_to(leaf[:1], leaf.shape))


def test_mass_is_conserved(adaptive_run):
  """sum_w m_new + n * update == sum_w (g + m_old), step by step."""
  _, grads, updates, states, _ = adaptive_run
  g = flat(grads)
  u = flat(updates)
  residuals = np.asarray(states.residual)  # [n, steps, N]
  previous = np.concatenate([np.zeros_like(residuals[:, :1]), residuals[:, :-1]], axis=1)
  accumulated = (g + previous).sum(axis=0)
  kept = residuals.sum(axis=0) + N_WORKERS * u[0]
  np.testing.assert_allclose(kept, accumulated, rtol=1e-6, atol=1e-6 * np.abs(accumulated).max())


def test_no_build_up_transmitted_is_the_sum_of_selections(adaptive_run):
  _, _, updates, states, _ = adaptive_run
  stats = jax.tree.map(lambda x: np.asarray(x)[0], states.stats)
  nonzero = (flat(updates)[0] != 0).sum(axis=-1)
  np.testing.assert_array_equal(stats.transmitted, np.minimum(stats.selected, stats.transmitted))
  np.testing.assert_array_equal(stats.selected - stats.overflow, stats.transmitted)
  np.testing.assert_array_equal(stats.workloads.sum(axis=-1), stats.selected)
  # Disjoint partitions: every transmitted index is distinct and nonzero here.
  assert (nonzero <= stats.transmitted).all()
  assert (nonzero >= stats.transmitted - 2).all()


def test_partitions_cover_all_blocks_and_respect_the_minimum(adaptive_run):
  _, _, _, states, _ = adaptive_run
  stats = jax.tree.map(lambda x: np.asarray(x)[0], states.stats)
  sizes, starts = stats.partition_sizes, stats.partition_starts
  np.testing.assert_array_equal(sizes.sum(axis=-1), BLOCKS)  # 66,650 = 63 x 1,042 + 1,004
  assert (sizes >= 1).all()
  np.testing.assert_array_equal(starts[:, 0], 0)
  np.testing.assert_array_equal(starts[:, 1:], np.cumsum(sizes, axis=-1)[:, :-1])
  assert (sizes != sizes[:1]).any(), "uneven gradients should move partition boundaries"


def test_stats_are_readable_from_a_chained_state_in_one_line():
  params = mixed_params()
  grads = uneven_grads(1, params, N_WORKERS, 3)
  tx = optax.chain(exdyna_jax.exdyna(0.01, num_blocks=BLOCKS), optax.sgd(0.1, momentum=0.9))
  _, _, final = harness.run_vmap(tx, params, grads)
  stats = optax.tree.get(final, "stats")
  assert isinstance(stats, exdyna_jax.SparsifierStats)
  chex.assert_trees_all_equal(exdyna_jax.get_stats(final), stats)
  np.testing.assert_array_equal(np.asarray(stats.step), 3)
  assert (np.asarray(stats.bytes_sent) > 0).all()


def test_shard_map_pmap_and_vmap_agree():
  """The reference controller's agreement is in test_exdyna_reference.py."""
  n = 4
  params = mixed_params()
  grads = uneven_grads(2, params, n, 6)
  tx = exdyna_jax.exdyna(0.01, num_blocks=BLOCKS)
  expected, expected_states, _ = harness.run_vmap(tx, params, grads)
  for run in (harness.run_pmap, harness.run_shard_map):
    updates, states, _ = run(tx, params, grads)
    chex.assert_trees_all_close(updates, expected, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_equal(
        states.stats.partition_sizes, expected_states.stats.partition_sizes
    )
    chex.assert_trees_all_close(states.stats.threshold, expected_states.stats.threshold, rtol=1e-6)


def test_shard_map_with_varying_types_returns_invariant_updates():
  """Under check_vma=True the mean update can leave through out_specs=P()."""
  n = 8
  params = mixed_params()
  tx = exdyna_jax.exdyna(0.01, num_blocks=BLOCKS)
  grads = jax.tree.map(lambda g: g[:, 0], uneven_grads(3, params, n, 1))

  def step(grads):
    state = tx.init(params)
    updates, _ = tx.update(jax.tree.map(lambda g: g[0], grads), state, params)
    return updates

  fn = jax.shard_map(step, mesh=harness.mesh_of(n), in_specs=P("data"), out_specs=P())
  updates = jax.jit(fn)(grads)
  expected, _, _ = harness.run_vmap(tx, params, jax.tree.map(lambda g: g[:, None], grads))
  expected = jax.tree.map(lambda u: u[0, 0], expected)
  chex.assert_trees_all_close(updates, expected, rtol=1e-5, atol=1e-6)


def test_gradients_already_summed_by_shard_map_are_rejected():
  """The hidden dense all-reduce: grad of replicated params under check_vma."""
  params = {"w": jnp.ones((64, 1024))}
  tx = exdyna_jax.exdyna(0.01, num_blocks=64)

  def step(x):
    state = tx.init(params)
    grads = jax.grad(lambda p: jnp.sum(x @ p["w"]))(params)
    return tx.update(grads, state, params)[0]

  fn = jax.shard_map(step, mesh=harness.mesh_of(8), in_specs=P("data"), out_specs=P())
  with pytest.raises(ValueError, match=r"already summed.*pcast"):
    jax.jit(fn)(jnp.ones((8, 64)))


def test_no_retracing_over_many_steps():
  params = mixed_params()
  tx = exdyna_jax.exdyna(0.01, num_blocks=BLOCKS)
  grads = uneven_grads(4, params, N_WORKERS, 1)
  grads = jax.tree.map(lambda g: g[:, 0], grads)

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(grads, state):
    return jax.vmap(lambda g, s: tx.update(g, s, params), axis_name="data")(grads, state)

  state = jax.vmap(lambda _: tx.init(params), axis_name="data")(jnp.arange(N_WORKERS))
  for _ in range(25):
    _, state = step(grads, state)
  assert int(exdyna_jax.get_stats(state).step[0]) == 25


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_narrow_gradients_give_narrow_updates_and_lose_nothing_to_rounding(dtype):
  """What rounding the update to the leaf dtype loses stays in the residuals."""
  params = {"w": jnp.zeros((128, 300), dtype), "b": jnp.zeros((300,), dtype)}
  grads = uneven_grads(5, params, N_WORKERS, 20, dtype=dtype)
  tx = exdyna_jax.exdyna(0.01, num_blocks=BLOCKS)
  updates, states, _ = harness.run_vmap(tx, params, grads)
  chex.assert_trees_all_equal_dtypes(updates, grads)
  g, u = flat(grads).astype(np.float64), flat(updates).astype(np.float64)
  residuals = np.asarray(states.residual)
  assert residuals.dtype == np.float32  # accumulation is float32 whatever the leaf dtype
  assert np.abs(u[0] - u[0].astype(dtype).astype(np.float64)).max() == 0  # representable
  # Over all steps: what every worker was given = what was applied n-fold + what is kept.
  given = g.sum(axis=(0, 1))
  kept_plus_sent = residuals[:, -1].sum(axis=0) + N_WORKERS * u[0].sum(axis=0)
  scale = np.abs(g).sum(axis=(0, 1)).max()
  np.testing.assert_allclose(kept_plus_sent, given, rtol=0, atol=1e-5 * scale)


def test_adaptive_controller_holds_the_target_density(adaptive_run):
  """Median |K/k - 1| within 3 % from step 20 on (uneven heavy-tailed gradients).

  The published rule, from the same start, moves the threshold by at most
  0.5 % per step: its first step is off by far more, the adaptive one is not.
  """
  params, _, _, states, _ = adaptive_run
  num_elements = sum(x.size for x in jax.tree.leaves(params))
  ratio = np.asarray(states.stats.selected[0]) / int(0.01 * num_elements)
  assert np.median(np.abs(ratio[20:] - 1)) <= 0.03, ratio
  assert np.all(np.abs(ratio[5:] - 1) <= 0.25), ratio


@pytest.mark.parametrize(
    "runner", [harness.run_vmap, harness.run_shard_map], ids=["vmap", "shard_map"]
)
@pytest.mark.parametrize("unrolled", [False, True])
def test_probe_counts_in_many_chunks_change_nothing(adaptive_run, runner, monkeypatch, unrolled):
  """Counted in chunks of 4,192 elements (about four per partition), the run is the same.

  With the default chunk size these 66,650 elements are counted in one chunk;
  the counts are exact integers either way, so thresholds, statistics and
  updates are identical. Also with each loop's first four chunks unrolled,
  as a GPU runs them (here forced on the CPU), short partitions included.
  """
  params, grads, updates, states, _ = adaptive_run
  steps = 15
  grads = jax.tree.map(lambda g: g[:, :steps], grads)
  monkeypatch.setattr(_selection, "MIN_CHUNK", _selection.ROW)
  if unrolled:
    monkeypatch.setattr(_selection, "UNROLLED_PLATFORMS", ("cpu",))
  num_elements = sum(x.size for x in jax.tree.leaves(params))
  assert _selection.chunk_length(num_elements, N_WORKERS) == 4192
  chunked_updates, chunked_states, _ = runner(
      exdyna_jax.exdyna(0.01, num_blocks=BLOCKS), params, grads
  )
  chex.assert_trees_all_equal(
      chunked_states.stats, jax.tree.map(lambda x: x[:, :steps], states.stats)
  )
  chex.assert_trees_all_equal(chunked_updates, jax.tree.map(lambda x: x[:, :steps], updates))


@pytest.mark.parametrize("name", ["exdyna", "micro"])
def test_a_step_loops_only_over_the_partition(name):
  """A GPU drives every loop iteration (and reads every conditional's predicate)
  from the host. On a CPU a step keeps two loops, the probe count and the
  selection over the worker's own partition, and two conditionals, the
  guard's count of bad elements (its loop runs only on a skipped step) and
  its check of a state that does not fit. On an NVIDIA GPU those passes are
  three Pallas kernels (`_range_kernels`: the probe count and the
  selection's two), no loop is left, and one conditional: the guard's
  check, after the step (the screen counts the bad elements in its pass).
  Searches over sorted arrays are unrolled."""
  tx = exdyna_jax.get_sparsifier(name, density=0.001, axis_name="data")
  params = jnp.zeros(200_000)
  state = jax.vmap(lambda _: tx.init(params), axis_name="data")(jnp.arange(8))
  step = jax.vmap(lambda g, s: tx.update(g, s, params), axis_name="data")
  jaxpr = jax.make_jaxpr(step)(jnp.ones((8, 200_000)), state).jaxpr
  for platform, loops, conditionals, pallas_calls in (("cpu", 2, 2, 0), ("cuda", 0, 1, 3)):
    outer, inside_kernels = [], []
    for eqn in harness.all_equations(jaxpr, platform):
      if eqn.primitive.name == "pallas_call":
        inside_kernels.append(eqn)
      skipped = _guard.SKIPPED_STEP_SCOPE in str(eqn.source_info.name_stack)
      if not skipped and not in_kernel(eqn, inside_kernels):
        outer.append(eqn)
      if eqn.primitive.name == "scan" and not skipped:
        unroll, length = eqn.params["unroll"], eqn.params["length"]
        assert unroll is True or unroll >= length, eqn.params
    primitives = [eqn.primitive.name for eqn in outer]
    assert primitives.count("while") == loops, platform
    assert primitives.count("cond") == conditionals, platform
    assert len(inside_kernels) == pallas_calls, platform


def in_kernel(eqn, kernels):
  """Whether ``eqn`` belongs to the body of one of the ``kernels`` (pallas_call equations)."""
  return any(any(eqn is inner for inner in harness.all_equations(kernel.params["jaxpr"], "cuda"))
             for kernel in kernels)


def test_overflow_stays_in_the_residual():
  params = mixed_params()
  grads = uneven_grads(7, params, N_WORKERS, 3)
  tx = exdyna_jax.exdyna(0.01, num_blocks=BLOCKS, capacity_factor=0.25, controller="reference")
  updates, states, _ = harness.run_vmap(tx, params, grads)
  stats = jax.tree.map(lambda x: np.asarray(x)[0], states.stats)
  capacity = int(np.ceil(0.25 * int(0.01 * 66650) / N_WORKERS))
  assert (stats.overflow > 0).all()
  assert (stats.transmitted <= N_WORKERS * capacity).all()
  np.testing.assert_array_equal((flat(updates)[0] != 0).sum(-1) <= stats.transmitted, True)


def test_plain_jit_helper_leaks_no_dense_all_reduce():
  """data_parallel: per-worker gradients, sparse exchange, no dense psum in HLO."""
  n = 8
  mesh = harness.mesh_of(n)
  leaves, treedef = jax.tree.flatten(mixed_params())
  keys = jax.random.split(jax.random.key(10), len(leaves))
  leaves = [0.1 * jax.random.normal(k, leaf.shape) for k, leaf in zip(keys, leaves, strict=True)]
  params = jax.tree.unflatten(treedef, leaves)
  params = jax.device_put(params, jax.NamedSharding(mesh, P()))
  num_elements = sum(x.size for x in jax.tree.leaves(params))

  def loss_fn(params, batch):
    x, y = batch
    h = x @ params["dense"]["w"] + params["dense"]["b"]
    return jnp.mean((h[:, :50] @ params["head"].T - y) ** 2) + params["scale"] ** 2 + jnp.sum(
        params["conv"] ** 2
    )

  dp = exdyna_jax.data_parallel(
      optax.chain(exdyna_jax.exdyna(0.01, num_blocks=BLOCKS), optax.sgd(0.1)), mesh
  )
  opt_state = dp.init(params)
  assert exdyna_jax.get_stats(opt_state).threshold.sharding.spec == P("data")

  @jax.jit
  def train_step(params, opt_state, batch):
    loss, grads = dp.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = dp.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  sharded = jax.NamedSharding(mesh, P("data"))
  batch = (
      jax.device_put(jax.random.normal(jax.random.key(8), (64, 256)), sharded),
      jax.device_put(jax.random.normal(jax.random.key(9), (64, 10)), sharded),
  )
  losses = []
  for _ in range(5):
    params, opt_state, loss = train_step(params, opt_state, batch)
    losses.append(float(loss))
  assert losses[-1] < losses[0]

  hlo = train_step.lower(params, opt_state, batch).compile().as_text()
  reduced = [
      int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
      for line in hlo.splitlines()
      if " all-reduce(" in line
      for dims in re.findall(r"[fsu]\d+\[([\d,]*)\]", line.split("all-reduce(")[0])
  ]
  assert reduced, "the sparse values are summed with one all-reduce"
  assert max(reduced) < num_elements // 10, f"a dense all-reduce leaked: sizes {reduced}"

  # Same updates as the per-worker (vmap) formulation of the same step.
  assert np.isfinite(losses).all()


def test_decorated_per_worker_step_equals_the_plain_jit_path():
  """data_parallel(...).step: the per-worker step, jitted and donated, with the state's
  worker axis handled; the same training as value_and_grad + update under jit."""
  n = 8
  mesh = harness.mesh_of(n)
  tx = optax.chain(exdyna_jax.topk(0.02), optax.sgd(0.1, momentum=0.9))  # compiles fastest
  dp = exdyna_jax.data_parallel(tx, mesh)
  rng = np.random.default_rng(4)
  x = rng.standard_t(3, size=(3, 64, 32)).astype(np.float32)  # [step, global batch, in]
  y = x @ rng.normal(size=(32, 40)).astype(np.float32)

  def loss_fn(params, batch):
    x, y = batch
    return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)

  @dp.step
  def train_step(params, opt_state, batch, scale):  # per worker; scale replicated
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(jax.tree.map(lambda g: scale * g, grads), opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, {"id": jax.lax.axis_index("data")}

  @jax.jit
  def jit_train_step(params, opt_state, batch):
    loss, grads = dp.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = dp.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  def fresh():
    return {"w": jnp.zeros((32, 40)), "b": jnp.zeros(40)}

  params, opt_state = fresh(), dp.init(fresh())
  expected_params, expected_state = fresh(), dp.init(fresh())
  for t in range(3):
    params, opt_state, losses, aux = train_step(params, opt_state, (x[t], y[t]), 1.0)
    expected_params, expected_state, loss = jit_train_step(
        expected_params, expected_state, (x[t], y[t])
    )
    np.testing.assert_allclose(losses.mean(), loss, rtol=1e-6)
  jax.tree.map(lambda a, e: np.testing.assert_allclose(a, e, rtol=1e-6, atol=1e-7),
               (params, opt_state), (expected_params, expected_state))
  assert losses.shape == (n,) and aux["id"].tolist() == list(range(n))  # one per worker
  assert optax.tree.get(opt_state, "residual").sharding.spec == P("data")
  stats = dp.stats(opt_state)  # the worker axis dropped
  assert isinstance(stats, exdyna_jax.SparsifierStats)
  assert int(stats.step) == 3 and stats.workloads.shape == (n,)
  assert int(stats.transmitted) > 0


def test_a_step_on_several_cpu_devices_returns_when_it_has_run():
  """XLA:CPU's collectives deadlock, or abort the process after 40 s, when steps queue up
  ahead of a process's CPU devices (docs/multihost.md, section 6): there the decorated step
  returns its outputs ready, as a loop reading its loss every step would."""
  tx = optax.chain(exdyna_jax.topk(0.02), optax.sgd(0.1))
  dp = exdyna_jax.data_parallel(tx, harness.mesh_of(8))
  x = np.random.default_rng(0).normal(size=(8 * 256, 256)).astype(np.float32)

  @dp.step
  def train_step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(lambda p: jnp.mean(jnp.tanh(batch @ p["w"]) ** 2))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  params = {"w": jnp.eye(256)}
  opt_state = dp.init(params)
  for _ in range(5):
    params, opt_state, losses = train_step(params, opt_state, x)
    assert all(leaf.is_ready() for leaf in jax.tree.leaves((params, opt_state, losses)))


def test_decorated_step_that_returns_no_state_is_refused():
  dp = exdyna_jax.data_parallel(exdyna_jax.topk(0.01), harness.mesh_of(8))
  step = dp.step(lambda params, opt_state, batch: params)
  params = jnp.zeros(1024)
  with pytest.raises(TypeError, match=r"must return a tuple \(params, opt_state, \*aux\)"):
    step(params, dp.init(params), jnp.zeros((8, 4)))


# ---------------------------------------------------------------- bad input


def _init_in_vmap(tx, params, n=N_WORKERS):
  return jax.vmap(lambda _: tx.init(params), axis_name="data", axis_size=n)(jnp.arange(n))


@pytest.mark.parametrize("density", [0.0, -0.1, 1.5, float("nan")])
def test_density_outside_unit_interval_is_rejected(density):
  with pytest.raises(ValueError, match=r"density must be in \(0, 1\]"):
    exdyna_jax.exdyna(density)


@pytest.mark.parametrize("capacity_factor", [0.0, -1.0])
def test_non_positive_capacity_factor_is_rejected(capacity_factor):
  with pytest.raises(ValueError, match="capacity_factor must be positive and finite"):
    exdyna_jax.exdyna(0.01, capacity_factor=capacity_factor)


def test_unknown_controller_is_rejected():
  with pytest.raises(ValueError, match=r"'adaptive'.*'reference'"):
    exdyna_jax.exdyna(0.01, controller="pid")


def test_too_few_blocks_for_the_published_rule_names_the_minimum():
  tx = exdyna_jax.exdyna(0.01, num_blocks=8, partitioner="reference")
  with pytest.raises(ValueError, match=r"Pass num_blocks >= 16"):
    _init_in_vmap(tx, mixed_params())


def test_model_smaller_than_the_published_blocks_names_the_fix():
  tx = exdyna_jax.exdyna(0.1, num_blocks=1024, partitioner="reference")
  with pytest.raises(ValueError, match=r"too few for num_blocks=1024.*Pass num_blocks <= 31"):
    _init_in_vmap(tx, {"w": jnp.zeros((1000,))})


def test_density_below_one_element_names_the_minimum():
  tx = exdyna_jax.exdyna(1e-9, num_blocks=64)
  with pytest.raises(ValueError, match=r"Pass density >="):
    _init_in_vmap(tx, mixed_params())


def test_unbound_axis_says_how_to_bind_it():
  tx = exdyna_jax.exdyna(0.01)
  with pytest.raises(ValueError, match=r"not bound.*shard_map.*pmap.*vmap.*data_parallel"):
    tx.init(mixed_params())


def test_integer_leaves_are_rejected_with_the_leaf_named():
  tx = exdyna_jax.exdyna(0.01, num_blocks=64)
  params = {**mixed_params(), "count": jnp.zeros((3,), jnp.int32)}
  with pytest.raises(TypeError, match=r"\['count'\].*int32"):
    _init_in_vmap(tx, params)


def test_update_tree_that_differs_from_the_init_tree_is_rejected():
  params = mixed_params()
  tx = exdyna_jax.exdyna(0.01, num_blocks=64)
  state = _init_in_vmap(tx, params)
  other = {**params, "extra": jnp.zeros((5,))}
  grads = jax.tree.map(lambda x: jnp.zeros((N_WORKERS, *x.shape)), other)
  with pytest.raises(ValueError, match="initialized for"):
    jax.vmap(lambda g, s: tx.update(g, s, params), axis_name="data")(grads, state)
  with pytest.raises(ValueError, match="initialized for"):
    jax.vmap(lambda g, s: tx.update(g, s), axis_name="data")(grads, state)


def test_one_data_parallel_step_is_traced_once_within_nine_library_frames(monkeypatch):
  """The update reads top to bottom: from ``data_parallel``'s train step to the deepest
  collective of an ExDyna step, at most 9 frames of the library are on the stack (the
  wrapper, its per-worker body, the shell's update, its step-and-writes (a schedule's
  branch), the guard, the step, the exchange, the index gather, the all-gather), and the
  method's Python runs once per trace."""
  from exdyna_jax.methods.exdyna import _exdyna_step

  depths, traced = [], []

  def spy(name):
    collective = getattr(jax.lax, name)

    def recorded(*args, **kwargs):
      depths.append(sum("/exdyna_jax/" in frame.filename for frame in traceback.extract_stack()))
      return collective(*args, **kwargs)

    monkeypatch.setattr(jax.lax, name, recorded)

  for name in ("psum", "all_gather", "psum_scatter", "ppermute", "all_to_all"):
    spy(name)
  next_state = _exdyna_step.next_state
  monkeypatch.setattr(_exdyna_step, "next_state",
                      lambda *a, **k: traced.append(1) or next_state(*a, **k))
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  tx = optax.chain(exdyna_jax.exdyna(0.01), optax.sgd(0.1))
  dp = exdyna_jax.data_parallel(tx, mesh)

  @dp.step
  def train_step(params, opt_state, batch):
    updates, opt_state = tx.update(batch[0], opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  opt_state = dp.init(jnp.zeros(4096))
  depths.clear()
  train_step(jnp.zeros(4096), opt_state, jnp.ones((8, 4096)))
  assert len(depths) >= 3 and max(depths) <= 9, depths  # probe counts, indices, values
  assert len(traced) == 1
