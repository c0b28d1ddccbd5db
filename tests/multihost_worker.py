"""One process of a multi-process run, for tests/test_multihost.py.

Run it under the launcher (``python -m exdyna_jax.launch --processes 2
--devices-per-process 2 -- python tests/multihost_worker.py OUT.npz``) or as a
single process with 4 devices (``--processes 1 --devices-per-process 4``):
the global mesh has the same 4 workers either way, and the same steps run.

It exercises, unchanged, what a user runs on several hosts:

* the shard_map path: ExDyna's ``init`` and ``update`` per worker over
  ``NUM_STEPS`` steps of fixed per-worker gradients;
* `exdyna_jax.data_parallel` under plain ``jax.jit``: a small linear model
  trained with ExDyna + SGD on a batch sharded over all processes.

Every step is blocked on (``jax.block_until_ready``): on CPU with more than
one device per process, the processes deadlock once the host runs more than
32 steps ahead of the devices (see docs/multihost.md).

Process 0 writes the per-worker results, gathered from all processes, to OUT.

Fault injection (for the fault tests): ``--die-at STEP --die-rank R`` makes
rank R exit with code 17 at that step; ``--hang-rank R`` makes rank R sleep
forever before joining.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

# Runnable as a script from anywhere: the package is installed; nothing else.
from exdyna_jax import launch

NUM_WORKERS = 4
NUM_STEPS = 40  # more than the 32 in-flight programs at which unblocked loops hang
DENSITY = 0.02
NUM_BLOCKS = 32
SHAPES = {"b": (48,), "w": (40, 64)}  # N = 2608
DP_STEPS = 12
DP_FEATURES, DP_OUTPUTS, DP_BATCH = 64, 16, 32


def parse_args(argv):
  parser = argparse.ArgumentParser()
  parser.add_argument("out", help="npz file process 0 writes")
  parser.add_argument("--die-at", type=int, default=-1)
  parser.add_argument("--die-rank", type=int, default=-1)
  parser.add_argument("--hang-rank", type=int, default=-1)
  parser.add_argument("--no-block", action="store_true", help="do not block each step")
  return parser.parse_args(argv)


def flat_gradients():
  """``[n, T, N]`` heavy-tailed per-worker gradients, uneven along the vector."""
  import numpy as np

  num_elements = sum(int(np.prod(s)) for s in SHAPES.values())
  rng = np.random.default_rng(7)
  scale = 0.01 * np.exp(2.0 * np.arange(num_elements) / num_elements)
  noise = rng.standard_t(3, size=(NUM_WORKERS, NUM_STEPS, num_elements))
  gain = 1.0 + 0.3 * np.arange(NUM_WORKERS)[:, None, None]
  return (noise * scale * gain).astype(np.float32)


def main(argv=None) -> int:
  args = parse_args(sys.argv[1:] if argv is None else argv)
  rank = int(os.environ.get(launch.PROCESS_ID_ENV, "0"))
  if rank == args.hang_rank:
    print("never joining", flush=True)
    while True:
      time.sleep(1)
  launch.initialize_from_env()

  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from jax import P
  from jax.experimental import multihost_utils

  import exdyna_jax

  assert jax.device_count() == NUM_WORKERS, jax.devices()
  print(
      f"process {jax.process_index()}/{jax.process_count()}: "
      f"{jax.local_device_count()} local of {jax.device_count()} devices",
      flush=True,
  )
  mesh = jax.make_mesh((NUM_WORKERS,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  per_worker = jax.sharding.NamedSharding(mesh, P("data"))

  def global_array(host_value):
    """A global array sharded over "data" from a value every process knows."""
    return jax.make_array_from_callback(host_value.shape, per_worker, lambda idx: host_value[idx])

  def wait(x):
    if not args.no_block:
      jax.block_until_ready(x)
    return x

  # --- shard_map path: init and update per worker. ---
  tx = exdyna_jax.exdyna(DENSITY, num_blocks=NUM_BLOCKS)
  params = {name: jnp.zeros(shape, jnp.float32) for name, shape in SHAPES.items()}
  flat = flat_gradients()
  sizes = [int(np.prod(s)) for s in SHAPES.values()]
  splits = np.cumsum(sizes)[:-1]

  def tree_at(t):
    parts = np.split(flat[:, t], splits, axis=-1)
    return {
        name: global_array(np.ascontiguousarray(part.reshape(NUM_WORKERS, *shape)))
        for (name, shape), part in zip(SHAPES.items(), parts, strict=True)
    }

  def shard(fn, in_specs, out_specs):
    return jax.jit(
        jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    )

  add = lambda tree: jax.tree.map(lambda x: x[None], tree)  # noqa: E731
  drop = lambda tree: jax.tree.map(lambda x: x[0], tree)  # noqa: E731
  init = shard(lambda: add(tx.init(params)), (), P("data"))

  def body(grads, state):
    updates, state = tx.update(drop(grads), drop(state), params)
    return add(updates), add(state)

  step = shard(body, (P("data"), P("data")), (P("data"), P("data")))
  state = wait(init())
  updates_log, stats_log = [], []
  for t in range(NUM_STEPS):
    if t == args.die_at and rank == args.die_rank:
      print(f"dying at step {t}", flush=True)
      os._exit(17)
    updates, state = wait(step(tree_at(t), state))
    updates_log.append(updates)
    stats_log.append(state.stats)
  # Per-worker leaves [n, ...] of every step, from all processes: [n, T, ...].
  updates_log, stats_log, residual = multihost_utils.process_allgather(
      (updates_log, stats_log, state.residual), tiled=True
  )
  updates = jax.tree.map(lambda *xs: np.stack(xs, 1), *updates_log)
  stats = jax.tree.map(lambda *xs: np.stack(xs, 1), *stats_log)

  # --- data_parallel under plain jax.jit, with a batch sharded over processes. ---
  rng = np.random.default_rng(3)
  true_w = rng.normal(size=(DP_FEATURES, DP_OUTPUTS)).astype(np.float32)
  dp_params = {
      "w": jnp.zeros((DP_FEATURES, DP_OUTPUTS), jnp.float32),
      "b": jnp.zeros((DP_OUTPUTS,), jnp.float32),
  }
  dp_tx = optax.chain(exdyna_jax.exdyna(0.05, num_blocks=16), optax.sgd(0.01))
  dp = exdyna_jax.data_parallel(dp_tx, mesh)

  def loss_fn(p, batch):
    x, y = batch
    return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)

  @jax.jit
  def train_step(p, opt_state, batch):
    loss, grads = dp.value_and_grad(loss_fn)(p, batch)
    updates, opt_state = dp.update(grads, opt_state, p)
    return optax.apply_updates(p, updates), opt_state, loss

  opt_state = wait(jax.jit(dp.init)(dp_params))
  losses = []
  for t in range(DP_STEPS):
    x = rng.normal(size=(DP_BATCH, DP_FEATURES)).astype(np.float32)
    x[:, : DP_FEATURES // 2] *= 1 + t % 3
    y = x @ true_w
    batch = (global_array(x), global_array(y))
    dp_params, opt_state, loss = wait(train_step(dp_params, opt_state, batch))
    losses.append(loss)
  dp_thresholds, dp_w = multihost_utils.process_allgather(
      (exdyna_jax.get_stats(opt_state).threshold, dp_params["w"]), tiled=True
  )

  if jax.process_index() == 0:
    np.savez(
        args.out,
        updates_w=updates["w"],
        updates_b=updates["b"],
        residual=residual,
        threshold=stats.threshold,
        selected=stats.selected,
        transmitted=stats.transmitted,
        workloads=stats.workloads,
        partition_starts=stats.partition_starts,
        partition_sizes=stats.partition_sizes,
        dp_losses=np.asarray([float(v) for v in losses]),
        dp_w=dp_w,
        dp_thresholds=dp_thresholds,
    )
  print("done", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
