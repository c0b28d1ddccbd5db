"""`local_steps`: local inner steps and a compressed outer sync, against a NumPy model."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import exdyna_jax
from tests.harness import AXIS, equations, mesh_of, unflatten_like
from tests.models import local_steps_model

NUM_WORKERS, NUM_STEPS, SYNC_EVERY = 4, 11, 3  # ends two steps into a round
SHAPES = {"b": (24,), "w": (8, 13)}  # N = 128, leaves in this order
PARAMS = {name: jnp.full(shape, 0.5, jnp.float32) for name, shape in SHAPES.items()}
NUM_ELEMENTS = 128
INNER = dict(inner_lr=0.1, inner_momentum=0.9)
OUTER = dict(outer_lr=0.7, outer_momentum=0.9, nesterov=True)


def gradients(seed: int = 0) -> np.ndarray:
  """``[n, T, N]`` heavy-tailed gradients that differ between workers."""
  rng = np.random.default_rng(seed)
  scale = np.exp(np.linspace(-3, 0, NUM_ELEMENTS))
  return (rng.standard_t(3, (NUM_WORKERS, NUM_STEPS, NUM_ELEMENTS)) * scale).astype(np.float32)


def flat(tree, lead: int = 2) -> np.ndarray:
  """A tree of ``[*lead axes, *leaf shape]`` leaves as ``[*lead axes, N]``."""
  leaves = [np.asarray(leaf) for leaf in jax.tree.leaves(tree)]
  return np.concatenate([leaf.reshape(*leaf.shape[:lead], -1) for leaf in leaves], axis=-1)


def run(tx, grads: np.ndarray, mapper: str = "vmap"):
  """Steps ``tx`` on every worker as a user would: params in, params + updates out.

  Returns ``(params [n, T, ...], states stacked [n, T, ...])``.
  """
  tree_grads = unflatten_like(grads, PARAMS)

  def per_worker(grads):
    def step(carry, g):
      params, state = carry
      updates, state = tx.update(g, state, params)
      params = optax.apply_updates(params, updates)
      return (params, state), (params, state)

    return jax.lax.scan(step, (PARAMS, tx.init(PARAMS)), grads)[1]

  if mapper == "vmap":
    return jax.jit(jax.vmap(per_worker, axis_name=AXIS))(tree_grads)
  body = lambda g: jax.tree.map(lambda x: x[None], per_worker(jax.tree.map(lambda x: x[0], g)))  # noqa: E731
  return jax.jit(jax.shard_map(body, mesh=mesh_of(NUM_WORKERS), in_specs=jax.P(AXIS),
                               out_specs=jax.P(AXIS), check_vma=False))(tree_grads)


def model(grads, density):
  initial = np.concatenate([np.asarray(PARAMS[k]).ravel() for k in sorted(PARAMS)])
  return local_steps_model.local_steps(grads, initial, sync_every=SYNC_EVERY,
                                       density=density, **INNER, **OUTER)


@pytest.mark.parametrize(("compressor", "density", "mapper"), [
    (lambda: exdyna_jax.dense(), None, "vmap"),
    (lambda: exdyna_jax.topk(0.1), 0.1, "vmap"),
    (lambda: exdyna_jax.topk(0.1), 0.1, "shard_map"),
])
def test_each_worker_steps_alone_and_the_syncs_apply_the_outer_step_to_the_exchanged_mean(
    compressor, density, mapper):
  grads = gradients()
  tx = exdyna_jax.local_steps(
      optax.sgd(INNER["inner_lr"], momentum=INNER["inner_momentum"]), sync_every=SYNC_EVERY,
      compressor=compressor(),
      outer=optax.sgd(OUTER["outer_lr"], momentum=OUTER["outer_momentum"], nesterov=True))
  params, states = run(tx, grads, mapper)
  expected = model(grads, density)

  np.testing.assert_allclose(flat(states.local), expected.local, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(flat(states.synced), np.broadcast_to(
      expected.synced, (*states.synced["b"].shape[:2], NUM_ELEMENTS)), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(flat(params), expected.local, rtol=1e-5, atol=1e-6)
  if density is not None:
    np.testing.assert_allclose(np.asarray(states.compressor.residual), expected.residuals,
                               rtol=1e-5, atol=1e-6)
  # Between syncs the workers differ; right after one they hold the synced parameters.
  after_sync = flat(states.local)[:, SYNC_EVERY - 1]
  assert np.array_equal(after_sync, np.broadcast_to(after_sync[0], after_sync.shape))
  assert not np.allclose(flat(states.local)[0, SYNC_EVERY], flat(states.local)[1, SYNC_EVERY])
  assert np.asarray(exdyna_jax.get_stats(states).step)[0, -1] == NUM_STEPS // SYNC_EVERY


def test_one_step_rounds_with_a_dense_mean_and_outer_rate_one_are_plain_data_parallel():
  grads = gradients(1)
  tx = exdyna_jax.local_steps(optax.sgd(0.1), sync_every=1, compressor=exdyna_jax.dense())
  params, _ = run(tx, grads)
  plain = optax.chain(exdyna_jax.dense(), optax.sgd(0.1))
  expected, _ = run(plain, grads)
  np.testing.assert_allclose(flat(params), flat(expected), rtol=1e-6, atol=1e-6)


def test_data_parallel_steps_keep_each_workers_parameters_and_return_the_synced_ones():
  grads = gradients(2)
  mesh = mesh_of(NUM_WORKERS)
  tx = exdyna_jax.local_steps(optax.sgd(0.1, momentum=0.9), sync_every=SYNC_EVERY,
                              compressor=exdyna_jax.exdyna(0.1))
  dp = exdyna_jax.data_parallel(tx, mesh)
  seen = []

  @dp.step
  def train_step(params, opt_state, batch):  # batch: this worker's gradient, [1, N]
    seen.append(params)
    updates, opt_state = tx.update(unflatten_like(batch[0], PARAMS), opt_state, params)
    return optax.apply_updates(params, updates), opt_state, params["b"][0]

  params, opt_state = PARAMS, dp.init(PARAMS)
  steps = []
  for t in range(NUM_STEPS):
    params, opt_state, first = train_step(params, opt_state, grads[:, t])
    steps.append((flat(params, 0), flat(opt_state.local, 1), np.asarray(first)))  # before donation
  _, states = run(tx, grads)
  for t, (params, local, first) in enumerate(steps):
    np.testing.assert_allclose(local, flat(states.local)[:, t], rtol=1e-6, atol=1e-7)
    # The params that leave the step are the synced ones; the step saw the worker's own.
    np.testing.assert_allclose(params, flat(states.synced)[0, t], rtol=1e-6, atol=1e-7)
    if t > 0:
      np.testing.assert_allclose(first, np.asarray(states.local["b"][:, t - 1, 0]), rtol=1e-6)
  assert not np.allclose(steps[-1][1][0], steps[-1][1][1])  # two steps into a round


def test_under_vmap_the_compressor_runs_only_at_a_sync():
  """The step count is batched under ``vmap``; the sync stays one conditional (a batched
  predicate would turn it into selects running the compressor every step)."""
  tx = exdyna_jax.local_steps(optax.sgd(0.1), sync_every=SYNC_EVERY,
                              compressor=exdyna_jax.topk(0.1))
  states = jax.vmap(lambda _: tx.init(PARAMS), axis_name=AXIS)(jnp.arange(NUM_WORKERS))
  grads = unflatten_like(gradients()[:, 0], PARAMS)
  params = jax.tree.map(lambda x: jnp.broadcast_to(x, (NUM_WORKERS, *x.shape)), PARAMS)
  program = jax.make_jaxpr(jax.vmap(tx.update, axis_name=AXIS))(grads, states, params)
  syncs = [eqn for eqn in equations(program.jaxpr) if eqn.primitive.name == "cond"
           and any(inner.primitive.name == "top_k"  # the compressor's selection
                   for branch in eqn.params["branches"] for inner in equations(branch.jaxpr))]
  assert len(syncs) == 1


def test_what_it_refuses():
  with pytest.raises(ValueError, match="sync_every"):
    exdyna_jax.local_steps(optax.sgd(0.1), sync_every=0, compressor=exdyna_jax.dense())
  with pytest.raises(TypeError, match="sync_every must be an int"):
    exdyna_jax.local_steps(optax.sgd(0.1), sync_every=True, compressor=exdyna_jax.dense())
  exdyna_jax.local_steps(optax.sgd(0.1), sync_every=np.int64(5), compressor=exdyna_jax.dense())
  # A compressor that exchanges nothing: every worker would train alone.
  alone = exdyna_jax.local_steps(optax.sgd(0.1), sync_every=2, compressor=optax.sgd(1.0))
  with pytest.raises(TypeError, match=r"local_steps' compressor is .*not one of this "
                                      r"package's methods.*train alone"):
    jax.vmap(alone.init, in_axes=None, axis_name=AXIS, axis_size=NUM_WORKERS)(PARAMS)
  hierarchical = exdyna_jax.hierarchical(exdyna_jax.topk(0.1, axis_name="node"))
  per_node = exdyna_jax.local_steps(optax.sgd(0.1), sync_every=2, compressor=hierarchical)
  jax.vmap(jax.vmap(per_node.init, in_axes=None, axis_name="local", axis_size=2),
           in_axes=None, axis_name="node", axis_size=2)(PARAMS)  # hierarchical(...) is one
  tx = exdyna_jax.local_steps(optax.sgd(0.1), sync_every=2, compressor=exdyna_jax.dense())
  with pytest.raises(ValueError, match="params="):
    jax.vmap(lambda g: tx.update(g, tx.init(PARAMS)), axis_name=AXIS)(
        jax.tree.map(lambda x: jnp.stack([x] * NUM_WORKERS), PARAMS))
  dp = exdyna_jax.data_parallel(tx, mesh_of(NUM_WORKERS))
  opt_state = dp.init(PARAMS)
  grads = jax.tree.map(lambda x: jnp.stack([x] * NUM_WORKERS), PARAMS)
  with pytest.raises(TypeError, match=r"dp\.step"):
    dp.update(grads, opt_state, PARAMS)


def linear_run(kind: str, tx, mesh, x: np.ndarray, steps: int):
  """The parameters after each of ``steps`` calls, for the same model stepped three ways."""
  from flax import nnx
  from flax.training.train_state import TrainState

  model = nnx.Linear(8, 4, rngs=nnx.Rngs(0))
  dp = exdyna_jax.data_parallel(tx, mesh)
  loss = lambda m, x: jnp.mean((m(x) - 1.0) ** 2)  # noqa: E731
  graphdef, params = nnx.split(model, nnx.Param)
  pure = nnx.as_pure(params)
  out = []
  if kind == "nnx":
    optimizer = exdyna_jax.nnx_optimizer(dp, model, wrt=nnx.Param)

    @exdyna_jax.nnx_step(dp)
    def step(model, optimizer, x):
      optimizer.update(model, nnx.grad(loss)(model, x))

    for _ in range(steps):
      step(model, optimizer, x)
      out.append(flat(nnx.as_pure(nnx.state(model, nnx.Param)), 0))
  elif kind == "train_state":
    state = exdyna_jax.create_train_state(dp, TrainState, apply_fn=None, params=pure)

    @exdyna_jax.train_state_step(dp)
    def step(state, x):
      grads = jax.grad(lambda p: loss(nnx.merge(graphdef, p), x))(state.params)
      return state.apply_gradients(grads=grads)

    for _ in range(steps):
      state = step(state, x)
      out.append(flat(state.params, 0))
  else:
    opt_state = dp.init(pure)

    @dp.step
    def step(params, opt_state, x):
      grads = jax.grad(lambda p: loss(nnx.merge(graphdef, p), x))(params)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state

    for _ in range(steps):
      pure, opt_state = step(pure, opt_state, x)
      out.append(flat(pure, 0))
  return np.stack(out)


@pytest.mark.parametrize("kind", ["nnx", "train_state"])
def test_flax_helpers_step_each_workers_parameters_and_keep_the_synced_ones(kind):
  mesh = mesh_of(NUM_WORKERS)
  x = np.random.default_rng(3).normal(size=(4 * NUM_WORKERS, 8)).astype(np.float32)
  tx = exdyna_jax.local_steps(optax.sgd(0.1), sync_every=2, compressor=exdyna_jax.topk(0.2))
  got = linear_run(kind, tx, mesh, x, 5)
  expected = linear_run("dp", tx, mesh, x, 5)
  np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)
  assert not np.array_equal(got[0], got[1]) and np.array_equal(got[1], got[2])  # moves at syncs


def dp_program(tx, mesh):
  """``(dp, train_step)``: the gradients of each worker are its own rows of the batch."""
  dp = exdyna_jax.data_parallel(tx, mesh)

  @dp.step
  def train_step(params, opt_state, batch):  # batch: this worker's gradient, [1, N]
    updates, opt_state = tx.update(unflatten_like(batch[0], PARAMS), opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return dp, train_step


@pytest.mark.filterwarnings("ignore:TraceState.*follows a sparsifier")  # an outer state to keep
def test_a_checkpoint_mid_round_resumes_bit_for_bit(tmp_path):
  import orbax.checkpoint as ocp

  grads = gradients(4)
  mesh = mesh_of(NUM_WORKERS)
  tx = exdyna_jax.local_steps(optax.adamw(0.05), sync_every=SYNC_EVERY,
                              compressor=exdyna_jax.exdyna(0.1),
                              outer=optax.sgd(0.7, momentum=0.9, nesterov=True))
  dp, train_step = dp_program(tx, mesh)
  params, opt_state = PARAMS, dp.init(PARAMS)
  for t in range(NUM_STEPS):
    params, opt_state = train_step(params, opt_state, grads[:, t])
    if t == 4:  # two steps into the second round
      with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "ckpt", {"params": params, "opt_state": opt_state})
  uninterrupted = jax.device_get((params, opt_state))

  target = {"params": PARAMS, "opt_state": dp.init(PARAMS)}
  with ocp.StandardCheckpointer() as checkpointer:
    restored = checkpointer.restore(tmp_path / "ckpt", target)
  params, opt_state = restored["params"], restored["opt_state"]
  for t in range(5, NUM_STEPS):
    params, opt_state = train_step(params, opt_state, grads[:, t])
  for got, want in zip(jax.tree.leaves(jax.device_get((params, opt_state))),
                       jax.tree.leaves(uninterrupted), strict=True):
    np.testing.assert_array_equal(got, want)


def test_resize_workers_keeps_the_synced_parameters_and_what_they_are_owed():
  grads = gradients(5)
  tx = exdyna_jax.local_steps(optax.sgd(0.1), sync_every=SYNC_EVERY,
                              compressor=exdyna_jax.topk(0.1))
  dp, train_step = dp_program(tx, mesh_of(NUM_WORKERS))
  params, opt_state = PARAMS, dp.init(PARAMS)
  for t in range(2 * SYNC_EVERY):  # ends on a sync
    params, opt_state = train_step(params, opt_state, grads[:, t])
  owed = np.asarray(opt_state.compressor.residual).mean(0)
  resized = exdyna_jax.resize_workers(tx, opt_state, params, 2)
  np.testing.assert_allclose(np.asarray(resized.compressor.residual).mean(0), owed,
                             rtol=1e-5, atol=1e-6)
  for leaf in (resized.synced, resized.local):
    np.testing.assert_array_equal(flat(leaf, 1), np.stack([flat(params, 0)] * 2))
  dp_2, train_step_2 = dp_program(tx, mesh_of(2))
  params, resized = train_step_2(params, jax.device_put(resized, jax.tree.map(
      lambda x: x.sharding, dp_2.init(PARAMS))), grads[:2, 0])
  assert int(resized.count[0]) == 2 * SYNC_EVERY + 1
