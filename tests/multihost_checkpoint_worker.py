"""One process of a multi-process checkpoint run, for tests/test_multihost.py.

Run under the launcher, e.g. with 2 processes x 2 CPU devices (4 workers)::

  python -m exdyna_jax.launch --processes 2 --devices-per-process 2 -- \\
      python tests/multihost_checkpoint_worker.py save CKPT_DIR OUT.npz
  python -m exdyna_jax.launch --processes 2 --devices-per-process 2 -- \\
      python tests/multihost_checkpoint_worker.py resume CKPT_DIR OUT.npz

A small linear model trained with ``optax.chain(ExDyna, SGD with momentum)``
on the shard_map path: params replicated (``P()``), the optimizer state per
worker with a leading worker axis sharded over ``"data"``, each worker's
batch its own.

* ``save``: ``STEPS_BEFORE`` steps, then every process calls orbax's
  ``StandardCheckpointer.save`` on the same directory (each writes the shards
  it owns; process 0 also writes the metadata and commits the checkpoint)
  and ``wait_until_finished``; then the run goes on for ``STEPS_AFTER`` more
  steps, uninterrupted.
* ``resume``: fresh processes build the same program, restore params and
  optimizer state onto the mesh (the target's shardings say where every shard
  goes), and run the same ``STEPS_AFTER`` steps.

Process 0 writes OUT: the state at the checkpoint (saved or restored), and
every later step's update, stats and final state, gathered from all
processes. Every step is blocked on (see docs/multihost.md, CPU note).
"""

from __future__ import annotations

import os
import sys

# Runnable as a script from anywhere: the package is installed; nothing else.
from exdyna_jax import launch

NUM_WORKERS = 4
STEPS_BEFORE, STEPS_AFTER = 5, 7
IN_FEATURES, OUT_FEATURES, BATCH = 32, 48, 8  # 1,584 parameters


def main(argv=None) -> int:
  phase, directory, out = sys.argv[1:] if argv is None else argv
  assert phase in ("save", "resume"), phase
  launch.initialize_from_env()

  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  import orbax.checkpoint as ocp
  from jax import P
  from jax.experimental import multihost_utils

  import exdyna_jax

  assert jax.device_count() == NUM_WORKERS, jax.devices()
  mesh = jax.make_mesh((NUM_WORKERS,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  per_worker = jax.sharding.NamedSharding(mesh, P("data"))
  replicated = jax.sharding.NamedSharding(mesh, P())

  def global_array(value, sharding):
    """A global array from a host value every process knows."""
    return jax.make_array_from_callback(value.shape, sharding, lambda idx: value[idx])

  rng = np.random.default_rng(1)
  steps = STEPS_BEFORE + STEPS_AFTER
  x = rng.standard_t(3, size=(steps, NUM_WORKERS, BATCH, IN_FEATURES)).astype(np.float32)
  teacher = rng.normal(size=(IN_FEATURES, OUT_FEATURES)).astype(np.float32)
  noise = rng.normal(size=(steps, NUM_WORKERS, BATCH, OUT_FEATURES)).astype(np.float32)
  y = x @ teacher + noise
  init_params = {
      "b": np.zeros((OUT_FEATURES,), np.float32),
      "w": (0.1 * np.random.default_rng(0).normal(size=(IN_FEATURES, OUT_FEATURES))).astype(
          np.float32
      ),
  }

  tx = optax.chain(exdyna_jax.exdyna(0.05, num_blocks=16), optax.sgd(0.05, momentum=0.9))

  def loss_fn(params, x, y):
    return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)

  def train_step(params, opt_state, x, y):
    opt_state = jax.tree.map(lambda s: s[0], opt_state)
    grads = jax.grad(loss_fn)(params, x[0], y[0])  # this worker's own gradient
    updates, opt_state = tx.update(grads, opt_state, params)
    return (
        optax.apply_updates(params, updates),
        jax.tree.map(lambda s: s[None], opt_state),
        updates,
    )

  init = jax.jit(
      jax.shard_map(
          lambda p: jax.tree.map(lambda s: s[None], tx.init(p)),
          mesh=mesh,
          in_specs=P(),
          out_specs=P("data"),
      )
  )
  step = jax.jit(
      jax.shard_map(
          train_step,
          mesh=mesh,
          in_specs=(P(), P("data"), P("data"), P("data")),
          out_specs=(P(), P("data"), P()),
          check_vma=False,  # keep each worker's gradient local
      )
  )

  params = jax.tree.map(lambda v: global_array(v, replicated), init_params)
  opt_state = jax.block_until_ready(init(params))

  def run(params, opt_state, t):
    batch = (global_array(x[t], per_worker), global_array(y[t], per_worker))
    return jax.block_until_ready(step(params, opt_state, *batch))

  checkpointer = ocp.StandardCheckpointer()
  path = os.path.join(directory, "state")
  if phase == "save":
    for t in range(STEPS_BEFORE):
      params, opt_state, _ = run(params, opt_state, t)
    # Every process calls save with the same path, and waits for the write.
    checkpointer.save(path, {"params": params, "opt_state": opt_state})
    checkpointer.wait_until_finished()
  else:
    # The target carries shapes, dtypes and shardings: each process reads
    # the shards its devices hold.
    target = jax.tree.map(
        ocp.utils.to_shape_dtype_struct, {"params": params, "opt_state": opt_state}
    )
    restored = checkpointer.restore(path, target)
    params, opt_state = restored["params"], restored["opt_state"]
  at_checkpoint = (params, opt_state)

  updates_log, stats_log = [], []
  for t in range(STEPS_BEFORE, steps):
    params, opt_state, updates = run(params, opt_state, t)
    updates_log.append(updates)
    stats_log.append(exdyna_jax.get_stats(opt_state))
  checkpointer.close()

  # Gather everything from all processes (per-worker leaves are not fully addressable).
  gathered = multihost_utils.process_allgather(
      (at_checkpoint, updates_log, stats_log, (params, opt_state)), tiled=True
  )
  at_checkpoint, updates_log, stats_log, final = gathered
  if jax.process_index() == 0:
    leaves = {}
    for prefix, tree in (("checkpoint", at_checkpoint), ("final", final)):
      for i, leaf in enumerate(jax.tree.leaves(tree)):
        leaves[f"{prefix}_{i}"] = np.asarray(leaf)
    for name, tree in (("updates", updates_log), ("stats", stats_log)):
      for i, leaf in enumerate(jax.tree.leaves(jax.tree.map(lambda *v: np.stack(v), *tree))):
        leaves[f"{name}_{i}"] = leaf
    saved_params, saved_state = at_checkpoint
    leaves["checkpoint_w"] = np.asarray(saved_params["w"])
    leaves["checkpoint_residual"] = np.asarray(optax.tree.get(saved_state, "residual"))
    leaves["checkpoint_momentum_w"] = np.asarray(optax.tree.get(saved_state, "trace")["w"])
    leaves["checkpoint_block_workloads"] = np.asarray(
        optax.tree.get(saved_state, "block_workloads")
    )
    leaves["final_w"] = np.asarray(final[0]["w"])
    stats = jax.tree.map(lambda *v: np.stack(v), *stats_log)
    for field in ("threshold", "selected", "partition_starts", "partition_sizes"):
      leaves[field] = np.asarray(getattr(stats, field))  # [T, n, ...]
    np.savez(out, **leaves)
  print(f"{phase} done", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
