"""The sparsifier inside optax and flax: what composes, in which order, and what is refused.

Rule of thumb: the sparsifier sees each worker's local gradient, so it comes
first in the chain; everything that should act on the aggregated gradient
(clipping, weight decay, momentum, learning-rate schedules) comes after it.
Gradient accumulation wraps the whole chain, so that the sparsifier runs
(and communicates) once per real step.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import P

import exdyna_jax
from tests import harness

NUM_WORKERS = 4
SHAPES = {"b": (40,), "w": (24, 40)}  # 1,000 elements
DENSITY = 0.05


def sparsifier():
  """Top-k: the composition is the shared shell's, and Top-k compiles fastest."""
  return exdyna_jax.topk(DENSITY)


def partitioned_sparsifier():
  """ExDyna, where the step counter also rotates and rebalances partitions."""
  return exdyna_jax.exdyna(DENSITY, num_blocks=16)


def params():
  rng = np.random.default_rng(7)
  return {name: jnp.asarray(rng.normal(size=shape), jnp.float32) for name, shape in SHAPES.items()}


@functools.cache
def gradients(steps: int, seed: int = 0):
  rng = np.random.default_rng(seed)
  return {
      name: rng.standard_t(3, size=(NUM_WORKERS, steps, *shape)).astype(np.float32)
      for name, shape in SHAPES.items()
  }


@functools.cache
def sparse_updates(steps: int):
  """What the sparsifier alone outputs for `gradients(steps)`, ``[n, T, ...]``."""
  return harness.run_vmap(sparsifier(), params(), gradients(steps))[0]


def assert_close(actual, expected):
  jax.tree.map(
      lambda a, e: np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=2e-6, atol=1e-7),
      actual,
      expected,
  )


# ---------------------------------------------------------------- MultiSteps


@pytest.mark.parametrize(
    "runner", [harness.run_vmap, harness.run_shard_map], ids=["vmap", "shard_map"]
)
def test_multisteps_around_the_chain_sparsifies_once_per_real_step(runner):
  """MultiSteps(chain(sparsifier, sgd)): micro-batches are averaged locally, then
  sparsified (and exchanged) once, as one step on the mean gradient."""
  micro_steps, real_steps = 3, 2
  grads = gradients(micro_steps * real_steps)
  tx = optax.MultiSteps(
      optax.chain(partitioned_sparsifier(), optax.sgd(0.1)), every_k_schedule=micro_steps
  )
  updates, states, _ = runner(tx, params(), grads)

  stats = exdyna_jax.get_stats(states)
  np.testing.assert_array_equal(np.asarray(stats.step)[0], [0, 0, 1, 1, 1, 2])
  mean_grads = jax.tree.map(
      lambda g: g.reshape(NUM_WORKERS, real_steps, micro_steps, *g.shape[2:]).mean(axis=2), grads
  )
  expected = jax.tree.map(
      lambda u: -0.1 * u, harness.run_vmap(partitioned_sparsifier(), params(), mean_grads)[0]
  )
  emitted = jax.tree.map(lambda u: u[:, micro_steps - 1 :: micro_steps], updates)
  assert_close(emitted, expected)
  for t in range(micro_steps * real_steps):
    if (t + 1) % micro_steps:
      for leaf in jax.tree.leaves(updates):
        np.testing.assert_array_equal(np.asarray(leaf)[:, t], 0)


def test_multisteps_inside_the_chain_sparsifies_every_micro_batch():
  """chain(sparsifier, MultiSteps(sgd)) is legal but pays the exchange on every
  micro-batch and accumulates sparse updates: wrap the whole chain instead."""
  grads = gradients(4)
  tx = optax.chain(partitioned_sparsifier(), optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2))
  _, states, _ = harness.run_vmap(tx, params(), grads)
  np.testing.assert_array_equal(np.asarray(exdyna_jax.get_stats(states).step)[0], [1, 2, 3, 4])


def test_multisteps_around_a_sparsifier_is_warned_about_and_a_skip_function_refused():
  """optax calls the inner update on every micro-step: data_parallel warns of the traffic;
  a per-worker skip function would put the workers out of step (a hang), so it is refused."""
  mesh = harness.mesh_of(NUM_WORKERS)
  chain = optax.chain(partitioned_sparsifier(), optax.sgd(0.1))
  with pytest.warns(UserWarning, match=r"every micro-step.*k times the traffic.*inside your step"):
    exdyna_jax.data_parallel(optax.MultiSteps(chain, 4), mesh).init(params())
  skipping = optax.MultiSteps(chain, 4, should_skip_update_fn=optax.skip_not_finite)
  with pytest.raises(ValueError, match=r"should_skip_update_fn.*falls out of step.*already "
                                       r"skips.*drop should_skip_update_fn"):
    exdyna_jax.data_parallel(skipping, mesh).init(params())


# ------------------------------------------------ transforms after the sparsifier


def test_clipping_and_weight_decay_after_the_sparsifier_see_the_aggregated_update():
  grads = gradients(3)
  clip, decay, lr = 0.5, 1e-2, 0.1
  tx = optax.chain(
      sparsifier(),
      optax.clip_by_global_norm(clip),
      optax.add_decayed_weights(decay),
      optax.sgd(lr),
  )
  updates, _, _ = harness.run_vmap(tx, params(), grads)

  sparse = sparse_updates(3)
  norm = jnp.sqrt(sum(jnp.sum(u**2, axis=tuple(range(2, u.ndim))) for u in jax.tree.leaves(sparse)))
  assert (norm > clip).all(), "the test must exercise the clipping"
  scale = jnp.minimum(1.0, clip / norm)
  expected = jax.tree.map(
      lambda u, p: -lr * (u * scale.reshape(scale.shape + (1,) * (u.ndim - 2)) + decay * p),
      sparse,
      params(),
  )
  assert_close(updates, expected)
  for leaf in jax.tree.leaves(updates):
    leaf = np.asarray(leaf)
    np.testing.assert_array_equal(leaf, np.broadcast_to(leaf[:1], leaf.shape))


def test_schedule_and_inject_hyperparams_drive_the_downstream_learning_rate():
  grads = gradients(4)
  schedule = optax.exponential_decay(0.1, transition_steps=1, decay_rate=0.5)
  for downstream in (optax.sgd(schedule), optax.inject_hyperparams(optax.sgd)(schedule)):
    updates, states, _ = harness.run_vmap(optax.chain(sparsifier(), downstream), params(), grads)
    rates = schedule(jnp.arange(4))
    expected = jax.tree.map(
        lambda u, r=rates: -r.reshape((1, 4) + (1,) * (u.ndim - 2)) * u, sparse_updates(4)
    )
    assert_close(updates, expected)
  # The state records the rate each step used.
  np.testing.assert_allclose(
      np.asarray(states[1].hyperparams["learning_rate"])[0], schedule(jnp.arange(4)), rtol=1e-6
  )


def test_a_hyperparameter_set_by_hand_needs_the_worker_axis_and_is_told_so():
  """``state[1].hyperparams["learning_rate"] = 0.01``, as optax documents it, has no worker
  axis: dp.step names the leaf and how to set it; set that way, the rate takes effect."""
  tx = optax.chain(sparsifier(), optax.inject_hyperparams(optax.sgd)(learning_rate=0.1))
  dp = exdyna_jax.data_parallel(tx, harness.mesh_of(NUM_WORKERS))

  @dp.step
  def train_step(params, opt_state, batch):
    updates, opt_state = tx.update(jax.tree.map(lambda g: g[0], batch), opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  opt_state = dp.init(params())
  opt_state[1].hyperparams["learning_rate"] = 0.0
  batch = jax.tree.map(lambda g: g[:, 0], gradients(1))  # a gradient a worker, as its batch
  with pytest.raises(ValueError, match=r"opt_state\[1\]\.hyperparams\['learning_rate'\] has "
                                       rf"shape \(\).*jnp\.full\({NUM_WORKERS}, 0\.01\)"):
    train_step(params(), opt_state, batch)
  opt_state[1].hyperparams["learning_rate"] = jnp.full(NUM_WORKERS, 0.0)
  new_params, _ = train_step(params(), opt_state, batch)
  for got, want in zip(jax.tree.leaves(new_params), jax.tree.leaves(params()), strict=True):
    np.testing.assert_array_equal(got, want)  # rate 0: nothing moves


def test_inject_hyperparams_around_the_whole_chain_needs_density_static():
  """density sizes the static buffers, so it cannot be a traced hyperparameter."""

  def chain(learning_rate, density):
    return optax.chain(exdyna_jax.topk(density), optax.sgd(learning_rate))

  grads = gradients(2)
  tx = optax.inject_hyperparams(chain, static_args=("density",))(0.1, DENSITY)
  updates, _, _ = harness.run_vmap(tx, params(), grads)
  assert_close(updates, jax.tree.map(lambda u: -0.1 * u, sparse_updates(2)))

  with pytest.raises(TypeError, match=r"density must be a concrete number.*static_args"):
    harness.run_vmap(optax.inject_hyperparams(chain)(0.1, DENSITY), params(), grads)


def test_inject_hyperparams_of_exdyna_names_every_static_option():
  """inject_hyperparams turns num_blocks into an array too; the message says what to do."""
  factory = optax.inject_hyperparams(exdyna_jax.exdyna)
  with pytest.raises(TypeError, match=r"must be a concrete number.*static_args="):
    harness.run_vmap(factory(density=DENSITY, num_blocks=8), params(), gradients(1))
  tx = optax.inject_hyperparams(exdyna_jax.exdyna, static_args=("density", "num_blocks"))(
      density=DENSITY, num_blocks=8
  )
  updates, _, _ = harness.run_vmap(tx, params(), gradients(2))
  expected, _, _ = harness.run_vmap(
      exdyna_jax.exdyna(DENSITY, num_blocks=8), params(), gradients(2)
  )
  assert_close(updates, expected)


# ---------------------------------------------------------------- flax NNX


class Linear(nnx.Module):
  def __init__(self):
    self.w = nnx.Param(params()["w"])
    self.b = nnx.Param(params()["b"])

  def __call__(self, x):
    return x @ self.w + self.b


def test_nnx_optimizer_runs_the_sparsifier_per_worker():
  """nnx.Optimizer(model, chain(sparsifier, ...)) built and stepped per worker,
  equals the plain optax loop and keeps the replicas identical."""
  steps = 3
  rng = np.random.default_rng(3)
  x = rng.normal(size=(NUM_WORKERS, steps, 8, 24)).astype(np.float32)
  y = rng.normal(size=(NUM_WORKERS, steps, 8, 40)).astype(np.float32)

  def make_tx():
    return optax.chain(sparsifier(), optax.sgd(0.1, momentum=0.9))

  def loss(model, x, y):
    return jnp.mean((model(x) - y) ** 2)

  def nnx_worker(x, y):
    model = Linear()
    optimizer = nnx.Optimizer(model, make_tx(), wrt=nnx.Param)
    for t in range(steps):
      optimizer.update(model, nnx.grad(loss)(model, x[t], y[t]))
    # The stats are typed both on the live optimizer and on its split nnx.State.
    split_stats = exdyna_jax.get_stats(nnx.split(optimizer)[1])
    assert isinstance(split_stats, exdyna_jax.SparsifierStats)
    assert isinstance(split_stats.transmitted, jax.Array)
    return {"b": model.b[...], "w": model.w[...]}, exdyna_jax.get_stats(optimizer.opt_state)

  def optax_worker(x, y):
    tx, p = make_tx(), params()
    state = tx.init(p)
    for t in range(steps):
      grads = jax.grad(lambda p, t=t: jnp.mean((x[t] @ p["w"] + p["b"] - y[t]) ** 2))(p)
      updates, state = tx.update(grads, state, p)
      p = optax.apply_updates(p, updates)
    return p

  run = lambda f: jax.jit(jax.vmap(f, axis_name=harness.AXIS))(x, y)  # noqa: E731
  nnx_params, stats = run(nnx_worker)
  expected = run(optax_worker)
  assert_close(nnx_params, expected)
  np.testing.assert_array_equal(np.asarray(stats.step), steps)
  for leaf in jax.tree.leaves(nnx_params):
    leaf = np.asarray(leaf)
    np.testing.assert_array_equal(leaf, np.broadcast_to(leaf[:1], leaf.shape))
  assert not np.allclose(np.asarray(nnx_params["w"])[0], params()["w"])


# ---------------------------------------------------- what does not compose


def test_a_transform_that_already_mixed_workers_before_the_sparsifier_is_refused():
  """A pmean before the sparsifier pays the dense all-reduce it exists to avoid;
  under shard_map(check_vma=True) the gradient type shows it and update raises."""
  mean_over_workers = optax.GradientTransformation(
      lambda p: optax.EmptyState(),
      lambda u, s, p=None: (jax.lax.pmean(u, harness.AXIS), s),
  )
  tx = optax.chain(mean_over_workers, partitioned_sparsifier())
  grads = jax.tree.map(lambda g: g[:, 0], gradients(1))

  def step(grads):
    state = tx.init(params())
    return tx.update(jax.tree.map(lambda g: g[0], grads), state, params())[0]

  fn = jax.shard_map(
      step, mesh=harness.mesh_of(NUM_WORKERS), in_specs=P(harness.AXIS), out_specs=P()
  )
  with pytest.raises(ValueError, match=r"already summed across workers.*first in the chain"):
    jax.jit(fn)(grads)


def test_a_stateful_transform_before_the_sparsifier_is_warned_about_by_data_parallel():
  """Adam's moments before the sparsifier: each worker's local gradient is preconditioned
  and the sparsifier compresses that. data_parallel's init sees it in the state's order."""
  mesh = harness.mesh_of(NUM_WORKERS)
  with pytest.warns(UserWarning, match=r"opt_state\[0\]\.mu.*runs before the sparsifier"):
    exdyna_jax.data_parallel(optax.chain(optax.scale_by_adam(), sparsifier()), mesh).init(
        params()
    )
  fine = [
      optax.chain(sparsifier(), optax.sgd(0.1)),
      optax.chain(optax.clip_by_global_norm(1.0), exdyna_jax.sparse_adamw(sparsifier(), 0.1)),
      optax.chain(exdyna_jax.dense(), optax.adamw(0.1)),  # dense sends everything
      exdyna_jax.local_steps(optax.adamw(0.1), sync_every=4, compressor=sparsifier()),
  ]
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    for tx in fine:
      exdyna_jax.data_parallel(tx, mesh).init(params())


@pytest.mark.parametrize("tx", [
    lambda: optax.chain(sparsifier(), optax.adam(0.1)),
    lambda: optax.MultiSteps(optax.chain(sparsifier(), optax.sgd(0.1, momentum=0.9)), 4),
    lambda: optax.inject_hyperparams(
        lambda lr: optax.chain(sparsifier(), optax.sgd(lr, 0.9)))(0.1),
    lambda: exdyna_jax.local_steps(optax.sgd(0.1), sync_every=4, compressor=sparsifier(),
                                   outer=optax.sgd(0.7, momentum=0.9, nesterov=True)),
    lambda: optax.chain(sparsifier(), optax.sgd(0.1, momentum=0.0)),
], ids=["adam", "multi_steps_momentum", "inject_hyperparams_momentum", "local_steps_outer",
        "momentum_zero"])
def test_momentum_or_adam_after_a_sparsifier_is_warned_about_by_data_parallel(tx):
  """They get the bursts error feedback releases; the warning names what to use instead,
  and that ``momentum=0.0`` keeps a trace (its state cannot tell 0 from 0.9)."""
  with pytest.warns(UserWarning, match=r"follows a sparsifier.*sparse_adamw.*1 / \(1 - momentum\)"
                    r".*clip_by_global_norm.*momentum=0\.0\) keeps a trace too: "
                    r"pass momentum=None"):
    exdyna_jax.data_parallel(tx(), harness.mesh_of(NUM_WORKERS)).init(params())


@pytest.mark.parametrize("leaves_out", ["masked", "multi_transform"])
def test_a_leaf_no_sparsifier_sees_is_refused_by_data_parallel(leaves_out):
  """Its gradient would stay each worker's own, and the params leaving the step worker 0's."""
  left_out = {
      "masked": optax.masked(sparsifier(), {"b": False, "w": True}),
      "multi_transform": optax.multi_transform(
          {"sparse": sparsifier(), "plain": optax.identity()}, {"b": "plain", "w": "sparse"}),
  }[leaves_out]
  dp = exdyna_jax.data_parallel(optax.chain(left_out, optax.sgd(0.1)), harness.mesh_of(NUM_WORKERS))
  with pytest.raises(ValueError, match=r"No sparsifier sees the gradient of \['b'\].*dense\(\)"):
    dp.init(params())


def test_a_chain_without_a_sparsifier_is_refused_by_data_parallel():
  dp = exdyna_jax.data_parallel(optax.sgd(0.1), harness.mesh_of(NUM_WORKERS))
  with pytest.raises(ValueError, match=r"tx holds no sparsifier.*exdyna_jax\.dense\(\)"):
    dp.init(params())


def test_a_gradient_without_the_worker_axis_is_refused_by_dp_update():
  """dp.update takes [n, ...] per-worker gradients; a global one is named, with the fix."""
  dp = exdyna_jax.data_parallel(optax.chain(sparsifier(), optax.sgd(0.1)),
                                harness.mesh_of(NUM_WORKERS))
  opt_state = dp.init(params())
  global_grads = jax.tree.map(lambda g: g[:, 0].mean(axis=0), gradients(1))
  with pytest.raises(ValueError, match=rf"leading worker axis of {NUM_WORKERS} .*gradient leaf "
                                       r"\['b'\] has "
                                       r"shape \(\d+,\), for a parameter of shape.*value_and_grad"):
    dp.update(global_grads, opt_state, params())


def test_leaves_kept_dense_in_their_own_group_get_the_exact_mean():
  """The documented way to keep biases dense: dense() in a multi_transform group."""
  tx = optax.chain(
      optax.multi_transform({"sparse": sparsifier(), "dense": exdyna_jax.dense()},
                            {"b": "dense", "w": "sparse"}),
      optax.sgd(1.0))
  dp = exdyna_jax.data_parallel(tx, harness.mesh_of(NUM_WORKERS))
  worker_grads = jax.tree.map(lambda g: g[:, 0], gradients(1))
  updates, opt_state = dp.update(worker_grads, dp.init(params()), params())
  np.testing.assert_allclose(updates["b"], -worker_grads["b"].mean(axis=0), rtol=1e-6)
  sent = np.count_nonzero(np.asarray(updates["w"]))
  assert 0 < sent <= NUM_WORKERS * int(DENSITY * 1000)  # w stays sparse: Top-k's union
  # Two sparsifiers' stats: the error says where each is, and each part reads alone.
  with pytest.raises(ValueError, match=r"2 sparsifiers' stats, at opt_state\[0\]\.inner_"):
    dp.stats(opt_state)
  sparse_stats = dp.stats(opt_state[0].inner_states["sparse"].inner_state)
  assert int(sparse_stats.transmitted) == sent


@pytest.mark.parametrize("batch, error, match", [
    ([1, 2, 3, 4], TypeError, r"batch\[0\] is a scalar \(int\).*jnp.asarray"),
    (7, TypeError, r"batch is a scalar"),
    (np.ones((6, 3), np.float32), ValueError, r"6 rows, which 4 workers cannot split"),
])
def test_a_batch_the_workers_cannot_split_says_what_to_pass(batch, error, match):
  tx = optax.chain(sparsifier(), optax.sgd(0.1))
  dp = exdyna_jax.data_parallel(tx, harness.mesh_of(NUM_WORKERS))

  @dp.step
  def train_step(params, opt_state, batch):
    return params, opt_state

  with pytest.raises(error, match=match):
    train_step(params(), dp.init(params()), batch)
  with pytest.raises(error, match=match):  # the pjit-style path checks alike
    dp.value_and_grad(lambda params, batch: 0.0)(params(), batch)


def test_batch_leaves_with_different_numbers_of_rows_are_refused():
  tx = optax.chain(sparsifier(), optax.sgd(0.1))
  dp = exdyna_jax.data_parallel(tx, harness.mesh_of(NUM_WORKERS))

  @dp.step
  def train_step(params, opt_state, batch):
    return params, opt_state

  batch = (np.ones((8, 3), np.float32), np.ones((4,), np.float32))
  with pytest.raises(ValueError, match=r"different numbers of rows \(batch\[0\]: 8, batch\[1"):
    train_step(params(), dp.init(params()), batch)


def test_python_numbers_come_back_as_one_per_worker():
  tx = optax.chain(sparsifier(), optax.sgd(0.1))
  dp = exdyna_jax.data_parallel(tx, harness.mesh_of(NUM_WORKERS))

  @dp.step
  def train_step(params, opt_state, batch):
    return params, opt_state, 1.0, {"count": 3}

  *_, one, count = train_step(params(), dp.init(params()), np.ones((4, 3), np.float32))
  assert one.tolist() == [1.0] * NUM_WORKERS and count["count"].tolist() == [3] * NUM_WORKERS


def test_the_train_step_names_keyword_arguments_it_cannot_take():
  tx = optax.chain(sparsifier(), optax.sgd(0.1))
  dp = exdyna_jax.data_parallel(tx, harness.mesh_of(NUM_WORKERS))

  @dp.step
  def train_step(params, opt_state, batch, scale):
    return params, opt_state

  with pytest.raises(TypeError, match=r"by position.*\['scale'\]"):
    train_step(params(), dp.init(params()), np.ones((4, 3), np.float32), scale=2.0)


def test_params_that_differ_across_workers_are_refused_after_the_first_call():
  """A step returning each worker's own value through the replicated params slot
  (BatchNorm statistics not averaged, say) stops at its first call, naming the leaf."""
  tx = optax.chain(sparsifier(), optax.sgd(0.1))
  dp = exdyna_jax.data_parallel(tx, harness.mesh_of(NUM_WORKERS))

  @dp.step
  def train_step(params, opt_state, batch, drift):
    updates, opt_state = tx.update(jax.tree.map(jnp.ones_like, params), opt_state, params)
    params = optax.apply_updates(params, updates)
    worker = jax.lax.axis_index(harness.AXIS)
    return {**params, "b": params["b"] + drift * worker}, opt_state

  batch = np.ones((NUM_WORKERS, 3), np.float32)
  same = train_step(params(), dp.init(params()), batch, 0.0)  # checked once: fine
  assert train_step(*same, batch, 1.0)[0]["b"].shape == params()["b"].shape  # not checked again
  fresh = dp.step(train_step.__wrapped__)
  with pytest.raises(ValueError, match=r"different values of params\['b'\].*pmean"):
    fresh(params(), dp.init(params()), batch, 1.0)


def least_squares_step(mesh):
  """``(dp, train_step)``: a per-worker step of ``sum((batch @ w) ** 2)``, Top-k then SGD."""
  tx = optax.chain(sparsifier(), optax.sgd(0.1))
  dp = exdyna_jax.data_parallel(tx, mesh)

  @dp.step
  def train_step(params, opt_state, batch):
    grads = jax.grad(lambda p: jnp.sum((batch @ p["w"]) ** 2))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return dp, train_step


def test_an_explicit_mesh_takes_an_unplaced_batch():
  """jax.make_mesh's default (Explicit axes): the step, its ``lower`` and ``dp.stats`` place
  params, batch and stats themselves."""
  mesh = jax.make_mesh((NUM_WORKERS,), (harness.AXIS,), devices=jax.devices()[:NUM_WORKERS])
  dp, train_step = least_squares_step(mesh)
  state = (params(), dp.init(params()))
  batch = np.ones((2 * NUM_WORKERS, 24), np.float32)
  for _ in range(2):
    state = train_step(*state, batch)
  assert state[0]["w"].sharding.is_fully_replicated
  assert int(dp.stats(state[1]).step) == 2
  assert "all-gather" in train_step.lower(*state, batch).compile().as_text()


def test_swapped_returns_are_named_when_the_step_is_traced():
  tx = optax.chain(sparsifier(), optax.sgd(0.1))
  dp = exdyna_jax.data_parallel(tx, harness.mesh_of(NUM_WORKERS))

  @dp.step
  def swapped(params, opt_state, batch):
    updates, opt_state = tx.update(jax.tree.map(jnp.ones_like, params), opt_state, params)
    return opt_state, optax.apply_updates(params, updates)

  @dp.step
  def forgot_the_state(params, opt_state, batch):
    return params, {"loss": jnp.zeros(())}

  batch = np.ones((NUM_WORKERS, 3), np.float32)
  with pytest.raises(TypeError, match=r"swapped returned \(opt_state, params\)"):
    swapped(params(), dp.init(params()), batch)
  with pytest.raises(TypeError, match=r"forgot_the_state returned a first or second output"):
    forgot_the_state(params(), dp.init(params()), batch)


def test_a_jit_of_the_users_around_the_train_step_runs():
  dp, train_step = least_squares_step(harness.mesh_of(NUM_WORKERS))
  state = (params(), dp.init(params()))
  for _ in range(2):
    state = jax.jit(train_step)(*state, np.ones((NUM_WORKERS, 24), np.float32))
  assert int(dp.stats(state[1]).step) == 2


def test_the_flax_helpers_take_data_parallel_first():
  """``nnx.Optimizer(model, tx)`` puts the model first; the helpers take ``dp`` first and
  say so (the swapped call failed with "'Linear' object has no attribute 'tx'")."""
  dp = exdyna_jax.data_parallel(optax.chain(exdyna_jax.topk(0.1), optax.sgd(0.1)),
                                harness.mesh_of(8))
  model = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
  calls = {
      "nnx_optimizer": lambda: exdyna_jax.nnx_optimizer(model, dp),
      "nnx_step": lambda: exdyna_jax.nnx_step(dp.tx),
      "create_train_state": lambda: exdyna_jax.create_train_state(
          model, apply_fn=None, params={}),
      "train_state_step": lambda: exdyna_jax.train_state_step(dp.mesh),
  }
  for name, call in calls.items():
    with pytest.raises(TypeError, match=rf"{name}\(dp.*data_parallel\(tx, mesh\) returns first"):
      call()
