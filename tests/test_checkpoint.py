"""Checkpoint and resume with orbax-checkpoint, in a fresh process, bit for bit.

The whole optimizer state (each worker's residual, the threshold, the
partitions, the counters, and the downstream momentum) is saved mid-training
with ``orbax.checkpoint.StandardCheckpointer``; a new Python process restores
it and finishes the run, which must equal the uninterrupted run exactly. Two
layouts are covered: shard_map (state leaves with a leading worker axis
sharded over ``'data'``, as in the README) and pmap (leading axis mapped over
devices, params replicated per device).

This file doubles as the script the fresh process runs:
``python -m tests.test_checkpoint <checkpoint dir> <output .npz>``.
"""

from __future__ import annotations

import functools
import gc
import os
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax import P

import exdyna_jax

AXIS = "data"
NUM_WORKERS = 4
STEPS_BEFORE, STEPS_AFTER = 5, 7
IN_FEATURES, OUT_FEATURES, BATCH = 32, 48, 8  # 1,584 parameters
LAYOUTS = ("shard_map", "pmap")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_tx() -> optax.GradientTransformation:
  return optax.chain(exdyna_jax.exdyna(0.05, num_blocks=16), optax.sgd(0.05, momentum=0.9))


def initial_params() -> dict[str, np.ndarray]:
  rng = np.random.default_rng(0)
  return {
      "b": np.zeros((OUT_FEATURES,), np.float32),
      "w": (0.1 * rng.normal(size=(IN_FEATURES, OUT_FEATURES))).astype(np.float32),
  }


def batches() -> tuple[np.ndarray, np.ndarray]:
  """Per-step, per-worker ``(x [T, n, B, in], y [T, n, B, out])``, uneven across workers."""
  rng = np.random.default_rng(1)
  steps = STEPS_BEFORE + STEPS_AFTER
  x = rng.standard_t(3, size=(steps, NUM_WORKERS, BATCH, IN_FEATURES)).astype(np.float32)
  teacher = rng.normal(size=(IN_FEATURES, OUT_FEATURES)).astype(np.float32)
  y = x @ teacher + rng.normal(size=(steps, NUM_WORKERS, BATCH, OUT_FEATURES)).astype(np.float32)
  return x, y


def loss_fn(params, x, y):
  return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


def mesh_of(num_workers: int) -> jax.sharding.Mesh:
  return jax.make_mesh(
      (num_workers,),
      (AXIS,),
      axis_types=(jax.sharding.AxisType.Auto,),
      devices=jax.devices()[:num_workers],
  )


@functools.cache
def shard_map_program(num_workers: int):
  """``(init, step)`` of the README's shard_map layout on ``num_workers`` devices."""
  tx, mesh = make_tx(), mesh_of(num_workers)

  def init(params):
    return jax.tree.map(lambda s: s[None], tx.init(params))

  def train_step(params, opt_state, x, y):
    opt_state = jax.tree.map(lambda s: s[0], opt_state)
    grads = jax.grad(loss_fn)(params, x[0], y[0])
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), jax.tree.map(lambda s: s[None], opt_state)

  init = jax.jit(jax.shard_map(init, mesh=mesh, in_specs=P(), out_specs=P(AXIS)))
  step = jax.jit(
      jax.shard_map(
          train_step,
          mesh=mesh,
          in_specs=(P(), P(AXIS), P(AXIS), P(AXIS)),
          out_specs=(P(), P(AXIS)),
          check_vma=False,
      )
  )
  return init, step


@functools.cache
def pmap_program():
  """``(init, step)`` of the pmap layout: params and state both mapped over devices."""
  tx, devices = make_tx(), jax.devices()[:NUM_WORKERS]

  def train_step(params, opt_state, x, y):
    updates, opt_state = tx.update(jax.grad(loss_fn)(params, x, y), opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  init = jax.pmap(tx.init, axis_name=AXIS, devices=devices)
  step = jax.pmap(train_step, axis_name=AXIS, devices=devices)
  return init, step


def start(layout: str):
  """``(step_fn, params, opt_state)`` before the first step."""
  params = initial_params()
  if layout == "shard_map":
    init, step = shard_map_program(NUM_WORKERS)
    return step, params, init(params)
  init, step = pmap_program()
  params = jax.tree.map(lambda p: np.stack([p] * NUM_WORKERS), params)
  return step, params, init(params)


def train(step, params, opt_state, steps: range):
  x, y = batches()
  for t in steps:
    params, opt_state = step(params, opt_state, x[t], y[t])
  return params, opt_state


def abstract(tree):
  """Restore target: shapes, dtypes and shardings of ``tree``."""
  return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)


def resume(checkpoint_dir: str, layout: str):
  """What a fresh process does: build the program, restore, finish the run."""
  step, params, opt_state = start(layout)
  target = abstract({"params": params, "opt_state": opt_state})
  restored = ocp.StandardCheckpointer().restore(os.path.join(checkpoint_dir, layout), target)
  remaining = range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER)
  return train(step, restored["params"], restored["opt_state"], remaining)


def _main(checkpoint_dir: str, output: str) -> None:
  leaves = {}
  for layout in LAYOUTS:
    for i, leaf in enumerate(jax.tree.leaves(resume(checkpoint_dir, layout))):
      leaves[f"{layout}_{i}"] = np.asarray(leaf)
  np.savez(output, **leaves)


# ---------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory):
  """Saves every layout after `STEPS_BEFORE` steps; returns the uninterrupted finals."""
  directory = tmp_path_factory.mktemp("checkpoints")
  checkpointer = ocp.StandardCheckpointer()
  uninterrupted, saved = {}, {}
  for layout in LAYOUTS:
    step, params, opt_state = start(layout)
    params, opt_state = train(step, params, opt_state, range(STEPS_BEFORE))
    checkpointer.save(directory / layout, {"params": params, "opt_state": opt_state})
    checkpointer.wait_until_finished()
    saved[layout] = (params, opt_state)
    uninterrupted[layout] = train(
        step, params, opt_state, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER)
    )
  return directory, saved, uninterrupted


def test_checkpoint_holds_the_whole_sparsifier_state(checkpointed):
  _, saved, _ = checkpointed
  _, opt_state = saved["shard_map"]
  stats = exdyna_jax.get_stats(opt_state)
  np.testing.assert_array_equal(np.asarray(stats.step), STEPS_BEFORE)
  assert optax.tree.get(opt_state, "residual").shape[0] == NUM_WORKERS
  assert optax.tree.get(opt_state, "residual").sharding.spec == P(AXIS)
  assert stats.partition_sizes.shape == (NUM_WORKERS, NUM_WORKERS)
  # The block estimate the partitions are cut from has left its start (1/16
  # each) by then, so a restore that reset it would show.
  estimate = np.asarray(optax.tree.get(opt_state, "block_workloads"))
  assert estimate.shape == (NUM_WORKERS, 16)
  assert not np.allclose(estimate, 1 / 16, rtol=1e-3)
  assert np.any(np.asarray(optax.tree.get(opt_state, "residual")) != 0)


def test_resume_in_a_fresh_process_is_bit_identical(checkpointed, tmp_path):
  directory, _, uninterrupted = checkpointed
  output = tmp_path / "resumed.npz"
  env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
  subprocess.run(
      [sys.executable, "-m", "tests.test_checkpoint", str(directory), str(output)],
      cwd=ROOT,
      env=env,
      check=True,
      timeout=300,
  )
  resumed = np.load(output)
  for layout in LAYOUTS:
    expected = jax.tree.leaves(uninterrupted[layout])
    assert len(expected) == len([k for k in resumed.files if k.startswith(layout)])
    for i, leaf in enumerate(expected):
      np.testing.assert_array_equal(resumed[f"{layout}_{i}"], np.asarray(leaf), err_msg=layout)
  # The run did something: params moved and replicas agree.
  params, _ = uninterrupted["pmap"]
  w = np.asarray(params["w"])
  np.testing.assert_array_equal(w, np.broadcast_to(w[:1], w.shape))
  assert not np.array_equal(w[0], initial_params()["w"])


@pytest.mark.filterwarnings(
    "ignore::RuntimeWarning", "ignore::pytest.PytestUnraisableExceptionWarning"
)
def test_restoring_onto_fewer_workers_names_the_fix(checkpointed):
  """Orbax refuses a target of another shape; a state it cut to fit (strict=False),
  or a state of the old shape on a smaller mesh, is refused by the sparsifier's update."""
  directory, _, _ = checkpointed
  half = NUM_WORKERS // 2
  init, step = shard_map_program(half)
  params = initial_params()
  checkpointer = ocp.StandardCheckpointer()
  with pytest.raises(ValueError, match="not compatible with the stored shape"):
    checkpointer.restore(
        directory / "shard_map", abstract({"params": params, "opt_state": init(params)})
    )
  gc.collect()  # orbax leaves the other shards' reads pending: drop them here

  # Orbax's truncation (strict=False) fits the shapes by cutting the worker
  # axis; the first update stops, since residuals were lost on the way.
  x, y = batches()
  truncated = checkpointer.restore(
      directory / "shard_map",
      abstract({"params": params, "opt_state": init(params)}),
      strict=False,
  )["opt_state"]
  with pytest.raises(
      (ValueError, jax.errors.JaxRuntimeError),
      match=rf"initialized for {NUM_WORKERS} workers but axis 'data' has {half}, and its "
      r"arrays were cut or padded.*strict=False.*resize_workers",
  ):
    jax.block_until_ready(step(params, truncated, x[0, :half], y[0, :half]))
  gc.collect()

  # Restoring with the saved shapes, laid out over the smaller mesh, succeeds...
  saved_init, _ = shard_map_program(NUM_WORKERS)
  sharding = jax.NamedSharding(mesh_of(half), P(AXIS))
  target = jax.tree.map(
      lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
      jax.eval_shape(saved_init, params),
  )
  opt_state = checkpointer.restore(
      directory / "shard_map", {"params": abstract(params), "opt_state": target}
  )["opt_state"]
  # ...but the first update says why the state cannot run there, and what to do.
  with pytest.raises(
      ValueError,
      match=rf"initialized for {NUM_WORKERS} workers but axis 'data' has {half}.*resize_workers",
  ):
    step(params, opt_state, x[0, :half], y[0, :half])
  # The fix it names runs: what the parameters are owed is kept and training goes on.
  resized = exdyna_jax.resize_workers(make_tx(), opt_state, params, half)
  np.testing.assert_allclose(
      optax.tree.get(resized, "residual").mean(0),
      np.asarray(optax.tree.get(opt_state, "residual")).mean(0),
      atol=1e-5,
  )
  _, resized = step(params, resized, x[0, :half], y[0, :half])
  assert np.isfinite(optax.tree.get(resized, "residual")).all()


if __name__ == "__main__":
  jax.config.update("jax_num_cpu_devices", 8)
  _main(*sys.argv[1:])


def test_restoring_without_a_target_names_the_fix(checkpointed):
  """Orbax without a target gives plain dicts and lists: the first update says how to restore."""
  directory, _, _ = checkpointed
  _, step = shard_map_program(NUM_WORKERS)
  restored = ocp.StandardCheckpointer().restore(directory / "shard_map")
  x, y = batches()
  with pytest.raises(TypeError, match=r"is a dict.*restored without a target.*StandardRestore"):
    step(restored["params"], restored["opt_state"], x[0], y[0])
  gc.collect()


@pytest.mark.parametrize("name", exdyna_jax.available_sparsifiers())
def test_a_state_for_renamed_leaves_is_refused_naming_them(name):
  """Two leaves of one size renamed so their order flips (``attention`` becomes ``norm``):
  the shapes fit, but each leaf's residual would be added to the other. The step stops
  and lists the leaves; ``dense()``, which holds no residual, goes on."""
  tx = exdyna_jax.get_sparsifier(name, **({} if name == "dense" else {"density": 0.05}))
  size = 256

  def init(tree):
    return jax.vmap(tx.init, in_axes=None, axis_name="data", axis_size=4)(tree)

  @jax.jit
  def step(state, grads):
    return jax.vmap(lambda g, s: tx.update(g, s)[1], axis_name="data")(grads, state)

  ones = np.ones((4, size), np.float32)
  saved = init({"attention": jnp.zeros(size), "mlp": jnp.zeros(size)})
  saved = step(saved, {"attention": ones, "mlp": 2 * ones})
  saved = step(saved, {"attention": ones, "mlp": 2 * ones})  # the same tree: no false alarm
  # A new process restores it onto the target its new model gives: the shapes fit.
  target = init({"mlp": jnp.zeros(size), "norm": jnp.zeros(size)})
  state = jax.tree.map(lambda _, stored: stored, target, saved)
  if name == "dense":
    jax.block_until_ready(step(state, {"mlp": ones, "norm": ones}))
    return
  with pytest.raises((ValueError, jax.errors.JaxRuntimeError),
                     match=r"laid out for another parameter tree.*renamed, reordered.*"
                           r"\['mlp'\] \(256,\), \['norm'\] \(256,\).*tx\.init"):
    jax.block_until_ready(step(state, {"mlp": ones, "norm": ones}))


@pytest.mark.parametrize(
    "tx", [exdyna_jax.get_sparsifier(name, **({} if name == "dense" else {"density": 0.05}))
           for name in exdyna_jax.available_sparsifiers()]
    + [exdyna_jax.exdyna(0.05, controller="reference", num_blocks=64)],
    ids=[*exdyna_jax.available_sparsifiers(), "exdyna_reference"])
def test_every_methods_state_round_trips_through_orbax(tx, tmp_path):
  """MiCRO's and the reference ExDyna's states held empty arrays, which orbax refuses to
  save ("Cannot save arrays with zero size")."""
  state = jax.vmap(tx.init, in_axes=None, axis_name="data", axis_size=4)(jnp.zeros(4096))
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "state", state)
  checkpointer.wait_until_finished()
  chex.assert_trees_all_equal(checkpointer.restore(tmp_path / "state", abstract(state)), state)
