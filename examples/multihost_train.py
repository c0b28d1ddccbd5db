"""Multi-host training with hierarchical ExDyna: one process per host.

On one machine, simulate 2 hosts with 2 CPU devices each::

  python -m exdyna_jax.launch --processes 2 --devices-per-process 2 -- \\
      python examples/multihost_train.py

On real hosts, set the ``EXDYNA_*`` variables on each (see
docs/multihost.md) and run ``python examples/multihost_train.py``.

The mesh is ``("node", "local")`` = (processes, devices per process): the
gradient is averaged densely over each host's devices and sparsified with
ExDyna across hosts only, told the network measured between them
(`exdyna_jax.Network.measure`).
"""

from exdyna_jax import launch

launch.initialize_from_env()  # before anything else uses JAX

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax import P  # noqa: E402

import exdyna_jax  # noqa: E402

STEPS, FEATURES, OUTPUTS, BATCH_PER_DEVICE = 60, 128, 32, 16


def main():
  devices = np.array(jax.devices()).reshape(jax.process_count(), jax.local_device_count())
  assert all(len({d.process_index for d in row}) == 1 for row in devices)  # a row is a host
  mesh = jax.sharding.Mesh(devices, ("node", "local"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  workers = P(("node", "local"))  # batch and per-device state: over all devices

  # What a message and a byte cost between the hosts, timed on every process
  # (all get the same figures): ExDyna prices its exchange's choices on it.
  network = exdyna_jax.Network.measure(mesh, "node")
  tx = optax.chain(
      exdyna_jax.hierarchical(
          exdyna_jax.exdyna(0.02, axis_name="node", num_blocks=64, network=network)),
      optax.sgd(0.5),  # no momentum after the sparsifier: 0.05 / (1 - 0.9)
  )
  params = {"w": jnp.zeros((FEATURES, OUTPUTS)), "b": jnp.zeros((OUTPUTS,))}

  dp = exdyna_jax.data_parallel(tx, mesh, axis_name=("node", "local"))  # a worker per device

  def loss_fn(p, x, y):
    return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)

  @dp.step
  def train_step(p, state, batch):  # per device: its own batch shard and state
    loss, grads = jax.value_and_grad(loss_fn)(p, *batch)
    updates, state = tx.update(grads, state, p)
    return optax.apply_updates(p, updates), state, jax.lax.pmean(loss, ("node", "local"))

  # Per-device values (the loss, the state) are not fully addressable: read
  # this process's first shard.
  first = lambda x: float(x.addressable_shards[0].data[0])  # noqa: E731

  rng = np.random.default_rng(0)  # same stream on every process
  true_w = rng.normal(size=(FEATURES, OUTPUTS)).astype(np.float32)
  batch = BATCH_PER_DEVICE * jax.device_count()
  sharding = jax.sharding.NamedSharding(mesh, workers)

  def global_batch(value):
    return jax.make_array_from_callback(value.shape, sharding, lambda idx: value[idx])

  state = dp.init(params)
  for t in range(STEPS):
    x = rng.normal(size=(batch, FEATURES)).astype(np.float32)
    y = x @ true_w
    # On CPU the step returns when it has run: with several devices per process,
    # the processes deadlock once the host runs ~32 steps ahead (docs/multihost.md).
    params, state, loss = train_step(params, state, (global_batch(x), global_batch(y)))
    if jax.process_index() == 0 and t % 10 == 0:
      threshold = first(exdyna_jax.get_stats(state).threshold)
      print(f"step {t:3d}  loss {first(loss):9.4f}  threshold {threshold:.4f}")
  if jax.process_index() == 0:
    print(f"final loss {first(loss):.4f}")


if __name__ == "__main__":
  main()
