"""resize_workers: a state of n workers continues on m, and the parameters get what they are owed.

Conservation across the resizes is the specification: each step the
parameters are owed the workers' mean gradient, and over a whole run,
8 -> 4 -> 8 -> 1 workers, what they were owed equals what was applied plus
the workers' mean residual (what they are still owed).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import exdyna_jax
from tests.harness import AXIS

N = 2048
STEPS = 3
OPTIONS = {"dense": {}, "exdyna": {"density": 0.02, "num_blocks": 64}}


def make_tx(name):
  if name == "chunked_topk_all_reduce":  # every element in 1 bit; the owners keep a residual too
    return exdyna_jax.chunked_topk(1.0, chunk=256, value_bits=1, wire="all_reduce")
  return exdyna_jax.get_sparsifier(name, **OPTIONS.get(name, {"density": 0.02}))


def stepper(tx):
  """``(state [n, ...], grads [n, T, N]) -> (state, update of every step)``, jitted."""
  params = jnp.zeros(N)

  def per_worker(state, grads):
    def step(state, g):
      update, state = tx.update(g, state, params)
      return state, update

    return jax.lax.scan(step, state, grads)

  @jax.jit
  def run(state, grads):
    state, updates = jax.vmap(per_worker, axis_name=AXIS, axis_size=grads.shape[0])(state, grads)
    return state, updates[0]  # identical on every worker

  return run


def still_owed(state):
  """The workers' mean residual (and the owners' of the mean): what the parameters have
  not yet received."""
  residual = optax.tree.get(state, "residual")
  owed = np.zeros(N) if residual is None else np.asarray(residual, np.float64).mean(0)
  shards = optax.tree.get(state, "shard_residual")
  return owed if shards is None else owed + np.asarray(shards, np.float64).reshape(-1)[:N]


@pytest.mark.parametrize("name", [*exdyna_jax.available_sparsifiers(), "chunked_topk_all_reduce"])
def test_eight_to_four_to_eight_to_one_workers_apply_what_was_owed(name):
  tx = make_tx(name)
  params = jnp.zeros(N)
  rng = np.random.default_rng(0)
  owed = np.zeros(N)  # the sum over steps of the workers' mean gradient
  applied = np.zeros(N)
  state = jax.vmap(tx.init, in_axes=None, axis_name=AXIS, axis_size=8)(params)
  run = stepper(tx)  # compiles once per worker count
  for workers in (8, 4, 8, 1):
    if optax.tree.get(state, "stats").workloads.shape[0] != workers:
      before = still_owed(state)
      state = exdyna_jax.resize_workers(tx, state, params, workers)
      np.testing.assert_allclose(still_owed(state), before, rtol=0, atol=1e-5)
    assert optax.tree.get(state, "stats").workloads.shape[0] == workers
    grads = rng.standard_t(3, size=(workers, STEPS, N)).astype(np.float32)
    state, updates = run(state, grads)
    updates = np.asarray(updates, np.float64)
    owed += grads.astype(np.float64).mean(axis=0).sum(axis=0)
    applied += updates.sum(axis=0)
    assert np.isfinite(updates).all() and np.isfinite(still_owed(state)).all()
  np.testing.assert_allclose(still_owed(state) + applied, owed, rtol=0, atol=1e-4)
  assert int(optax.tree.get(state, "stats").step[0]) == 4 * STEPS


def test_a_flush_after_resizing_applies_exactly_what_was_owed():
  """8 workers hold residuals; on 2 (or 16), a dense step of zero gradients hands the
  parameters the old workers' mean residual, not m/n times it."""
  tx = exdyna_jax.topk(0.02)
  params = jnp.zeros(N)
  grads = np.random.default_rng(2).normal(size=(8, STEPS, N)).astype(np.float32)
  state, updates = stepper(tx)(jax.vmap(tx.init, in_axes=None, axis_name=AXIS, axis_size=8)(
      params), grads)
  owed = grads.astype(np.float64).mean(0).sum(0) - np.asarray(updates, np.float64).sum(0)
  flush = exdyna_jax.topk(1.0)  # sends everything: the same state type, a dense step
  for workers in (2, 16):
    resized = exdyna_jax.resize_workers(tx, state, params, workers)
    _, flushed = stepper(flush)(resized, np.zeros((workers, 1, N), np.float32))
    np.testing.assert_allclose(np.asarray(flushed[0], np.float64), owed, rtol=0, atol=1e-5)


def test_leaves_the_workers_hold_apart_become_their_mean():
  """optax.MultiSteps' accumulated gradient differs per worker between emitted steps."""
  tx = optax.MultiSteps(optax.chain(make_tx("exdyna"), optax.sgd(0.1)), every_k_schedule=2)
  params = jnp.zeros(N)
  grads = np.random.default_rng(3).normal(size=(8, 1, N)).astype(np.float32)
  state, _ = stepper(tx)(jax.vmap(tx.init, in_axes=None, axis_name=AXIS, axis_size=8)(params),
                         grads)
  resized = exdyna_jax.resize_workers(tx, state, params, 4)
  np.testing.assert_allclose(resized.acc_grads, np.stack([grads[:, 0].mean(0)] * 4), atol=1e-6)
  np.testing.assert_array_equal(resized.mini_step, [1] * 4)  # the same on every worker: kept


def test_an_integer_leaf_the_workers_hold_apart_is_refused():
  tx = optax.chain(make_tx("topk"), optax.scale_by_schedule(lambda count: 1.0))
  params = jnp.zeros(N)
  state = jax.vmap(tx.init, in_axes=None, axis_name=AXIS, axis_size=4)(params)
  state = (state[0], optax.ScaleByScheduleState(count=jnp.arange(4, dtype=jnp.int32)))
  with pytest.raises(ValueError, match=r"int32 leaf of the state differs between workers.*"
                                       r"an integer has none"):
    exdyna_jax.resize_workers(tx, state, params, 2)


def test_the_rest_of_the_chain_and_the_controller_carry_over():
  tx = optax.chain(make_tx("exdyna"), optax.sgd(0.1, momentum=0.9))
  params = jnp.zeros(N)
  grads = np.random.default_rng(1).normal(size=(8, 3, N)).astype(np.float32)
  state = jax.vmap(tx.init, in_axes=None, axis_name=AXIS, axis_size=8)(params)
  state, _ = stepper(tx)(state, grads)
  resized = exdyna_jax.resize_workers(tx, state, params, 2)
  np.testing.assert_array_equal(resized[1][0].trace, np.stack([state[1][0].trace[0]] * 2))
  np.testing.assert_array_equal(resized[0].threshold, np.full(2, state[0].threshold[0]))
  np.testing.assert_array_equal(resized[0].step, [3, 3])
  assert resized[0].partition_sizes.shape == (2, 2)
  assert int(resized[0].partition_sizes[0].sum()) == 64


def test_a_state_of_another_optimizer_or_layout_is_refused():
  tx = make_tx("topk")
  params = jnp.zeros(N)
  state = jax.vmap(tx.init, in_axes=None, axis_name=AXIS, axis_size=4)(params)
  with pytest.raises(ValueError, match="does not belong to this optimizer"):
    exdyna_jax.resize_workers(optax.chain(tx, optax.sgd(0.1)), state, params, 2)
  with pytest.raises(ValueError, match="leading worker axis"):
    exdyna_jax.resize_workers(tx, jax.tree.map(lambda x: x[0], state), params, 2)
  with pytest.raises(ValueError, match="positive int"):
    exdyna_jax.resize_workers(tx, state, params, 0)
  # Another method's tx: it used to convert the state and fail at training (AttributeError).
  with pytest.raises(ValueError, match=r"state is ErrorFeedbackState; tx\.init makes "
                                       r"ExDynaState: it was trained with another method"):
    exdyna_jax.resize_workers(make_tx("exdyna"), state, params, 2)


def cut_or_pad(state, target):
  """What orbax's ``strict=False`` restore does: each leaf cut or zero-padded to fit."""

  def fit(leaf, like):
    leaf = np.asarray(leaf)[tuple(slice(0, size) for size in like.shape)]
    return np.pad(
      leaf, [(0, want - have) for have, want in zip(leaf.shape, like.shape, strict=True)]
    )

  return jax.tree.map(fit, state, target)


@pytest.mark.parametrize(
    ("name", "saved", "restored"),
    [(name, 8, 4) for name in exdyna_jax.available_sparsifiers()] + [("exdyna", 4, 8)])
def test_a_worker_axis_cut_or_padded_to_fit_is_refused(name, saved, restored):
  """The shapes fit, the recorded worker count does not: the step stops and names the fix.

  Every method's state cut to fewer workers; one padded to more (the shell's check)."""
  tx = make_tx(name)

  def init(workers):
    return jax.vmap(tx.init, in_axes=None, axis_name=AXIS, axis_size=workers)(jnp.zeros(N))

  fitted = cut_or_pad(init(saved), init(restored))
  grads = np.ones((restored, 1, N), np.float32)
  with pytest.raises(
    (ValueError, jax.errors.JaxRuntimeError),
    match=rf"initialized for ({saved}|another number of) workers but axis 'data' has {restored}, "
    r"and its arrays were cut or padded.*resize_workers",
  ):
    jax.block_until_ready(stepper(tx)(fitted, grads))


def test_a_cut_state_is_refused_on_every_device_of_a_mesh():
  """Workers simulated with ``vmap`` in a program sharded over a mesh of
  automatic axes (``jax.set_mesh``): the check runs on every device, so the
  step raises instead of leaving seven devices waiting for the eighth's."""
  tx = make_tx("exdyna")
  mesh = jax.make_mesh((8,), ("devices",), axis_types=(jax.sharding.AxisType.Auto,))
  init = jax.vmap(tx.init, in_axes=None, axis_name=AXIS, axis_size=8)
  fitted = cut_or_pad(init(jnp.zeros(N)), init(jnp.zeros(N)))
  fitted = fitted._replace(stats=fitted.stats._replace(num_workers=np.full(8, 4, np.int32)))
  on_devices = jax.NamedSharding(mesh, jax.P("devices"))
  state, grads = jax.device_put((fitted, np.ones((8, 1, N), np.float32)), on_devices)
  with jax.set_mesh(mesh), pytest.raises(
      jax.errors.JaxRuntimeError, match=r"initialized for 4 workers but axis 'data' has 8"):
    jax.block_until_ready(stepper(tx)(state, grads))


def test_a_hierarchical_state_is_refused_with_what_to_do():
  """Its init needs the fast axis bound too: the error says it cannot be resized and why."""
  tx = exdyna_jax.hierarchical(exdyna_jax.topk(0.25, axis_name="node"))
  params = jnp.zeros(N)
  per_node = jax.vmap(tx.init, in_axes=None, axis_name="local", axis_size=2)
  state = jax.vmap(per_node, in_axes=None, axis_name="node", axis_size=2)(params)
  state = jax.tree.map(lambda x: x.reshape(4, *x.shape[2:]), state)
  with pytest.raises(ValueError, match=r"one worker axis, 'node'.*fast axis 'local' is not "
                                       r"bound.*cannot be resized.*tx\.init on the new mesh"):
    exdyna_jax.resize_workers(tx, state, params, 2, axis_name="node")
