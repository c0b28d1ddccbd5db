"""One process of `benchmarks/cluster.py`: times the train step a user runs, per method.

Started by ``exdyna_jax.launch`` (one CPU device per process, or several in
one process for the local runs). For each method it builds
``optax.chain(method, optax.sgd(...))`` and the step
``exdyna_jax.data_parallel(tx, mesh).step`` (jitted, params and state
donated, the state returned first), trains ``--warmup`` steps, then times
``--steps`` steps, each blocked on, and process 0 prints one JSON line per
method. ``compute`` is the same gradient and SGD with no exchange at all
(each worker applies its own gradient): the step's compute alone.
Three floors (`FLOORS`) replay ``exdyna_network``'s compiled step:
``exdyna_network_rounds`` is compute plus its collectives (the same kinds and
sizes, in order) and no other work (`rounds_only`);
``exdyna_network_two_rounds`` leaves out the first (the guard's ``psum``);
``exdyna_network_shell`` is the library's error-feedback shell (the guard,
``a = g + m`` in place, the dense update, the residual cleared) around the
same collectives, its values taken at indices chosen for free
(`shell_only`): ExDyna less its partitions, probe count, selection and
threshold.
``hierarchical`` and ``hierarchical_psum`` (several devices per process) are
ExDyna across the processes only, ``hierarchical(exdyna(axis_name="node"),
fast_axis="local")`` on a ``("node", "local")`` mesh, one row per process:
the gradient is reduce-scattered (``fast_reduce="scatter"``) or all-reduced
(``"psum"``) densely inside each process first.

The model is an MLP ``features-hidden-hidden-10`` on fixed random data,
``--batch`` examples per worker.
"""

from __future__ import annotations

from exdyna_jax import launch

launch.initialize_from_env()

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import exdyna_jax  # noqa: E402
from benchmarks import _common  # noqa: E402
from exdyna_jax import hlo  # noqa: E402
from exdyna_jax.core import _stats  # noqa: E402
from exdyna_jax.demo import tasks  # noqa: E402
from exdyna_jax.demo.cluster_worker import (  # noqa: E402
  AXIS,
  barrier,
  local_value,
  put,
)
from exdyna_jax.demo.trainer import make_mesh  # noqa: E402
from exdyna_jax.exchange import _exchange  # noqa: E402
from exdyna_jax.shell import _feedback  # noqa: E402

# name -> (registered method, options); "compute" has no sparsifier.
VARIANTS = {
    "compute": (None, {}),
    "dense": ("dense", {}),
    "exdyna": ("exdyna", {}),
    "exdyna_nospill": ("exdyna", {"spill": False}),
    "exdyna_reference": ("exdyna", {"controller": "reference"}),
    "exdyna_network": ("exdyna", {"network": "measure"}),  # `Network.measure` on the mesh
    "micro": ("micro", {}),
    "spardl": ("spardl", {}),
    "topk": ("topk", {}),
    "cltk": ("cltk", {}),
    "hard_threshold": ("hard_threshold", {}),
    "exdyna_network_rounds": (None, {}),  # floors: see FLOORS
    "exdyna_network_two_rounds": (None, {}),
    "exdyna_network_shell": ("shell", {}),  # not registered: marks the library's state and stats
    "hierarchical": ("exdyna", {}),  # across processes only: see hierarchical_step
    "hierarchical_psum": ("exdyna", {}),
}
NODE, LOCAL = "node", "local"
FAST_REDUCE = {"hierarchical": "scatter", "hierarchical_psum": "psum"}


def make_tx(variant: str, density: float, learning_rate: float,
            network: exdyna_jax.Network | None = None):
  method, options = VARIANTS[variant]
  if options.get("network") == "measure":
    options = {**options, "network": network}
  sgd = optax.sgd(learning_rate)
  if method is None:
    return sgd
  if method != "dense":
    options = {"density": density, **options}
  if variant in FAST_REDUCE:
    sparsifier = exdyna_jax.get_sparsifier(method, axis_name=NODE, **options)
    hierarchical = exdyna_jax.hierarchical(
        sparsifier, fast_axis=LOCAL, fast_reduce=FAST_REDUCE[variant])
    return optax.chain(hierarchical, sgd)
  return optax.chain(exdyna_jax.get_sparsifier(method, axis_name=AXIS, **options), sgd)


def replay(op: dict, word: jax.Array) -> jax.Array:
  """Runs the collective ``op`` (its kind and result size) on float32 words filled with ``word``.

  Returns the first word of its result, so the next one runs after it.
  """
  words = op["result_bytes"] // 4
  if op["kind"] == "all-reduce":
    return jax.lax.psum(jnp.full((words,), word), AXIS)[0]
  if op["kind"] == "all-gather":
    shard = words // jax.lax.axis_size(AXIS)
    return jax.lax.all_gather(jnp.full((shard,), word), AXIS)[-1, -1]
  raise ValueError(f"no replay of a {op['kind']}")


def rounds_only(collectives: list[dict]) -> optax.GradientTransformation:
  """The worker's own gradient, after ``collectives`` (kinds and result sizes) and nothing else.

  The first collective moves the gradient's first element, each next one
  the last one's first word (`replay`), so they run in order after the
  gradient; the update is the gradient times one plus zero times the last
  word, which XLA cannot fold, so SGD waits for them, and it fuses into the
  SGD's one pass (no pass over ``N`` the compute step does not make).
  """
  def update_fn(updates, state, params=None):
    del params
    word = jax.tree.leaves(updates)[0].reshape(-1)[0]
    for op in collectives:
      word = replay(op, word)
    scale = 1 + 0 * word
    return jax.tree.map(lambda g: g * scale, updates), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def shell_only(collectives: list[dict], density: float) -> optax.GradientTransformation:
  """The error-feedback shell around ``collectives``, its values at indices chosen for free.

  The shell runs the first collective itself (the guard's ``psum``) and the
  passes every method makes: the screen, ``a = g + m``, the dense update,
  the residual cleared where the values were sent. In between, the
  collectives but the last are replayed (`replay`, from ``a``'s first
  element), and the last one sums the workers' values (``psum`` or
  all-gather, as it did; `_exchange.aggregate_at`) at as many indices as it
  carried, spread over ``N`` without reading the gradient.
  """
  *control, values = collectives[1:]
  gather = values["kind"] == "all-gather"

  def sparsify(accumulated, stats, num_workers, k):
    num_elements = accumulated.shape[0]
    word = accumulated[0]
    for op in control:
      word = replay(op, word)
    slots = values["result_bytes"] // 4 // (num_workers if gather else 1)
    after = (0 * word).astype(jnp.int32)  # 0, which XLA cannot fold: the sum waits for them
    indices = jnp.arange(slots, dtype=jnp.int32) * (num_elements // slots) + after
    sparse = _exchange.aggregate_at(accumulated, indices, AXIS, gather=gather)
    return sparse, _stats.unpartitioned_stats(
        stats, threshold=jnp.float32(0), selected=jnp.int32(slots),
        transmitted=jnp.int32(slots), overflow=jnp.int32(0),
        workloads=jnp.full((num_workers,), slots // num_workers), num_elements=num_elements,
        target=k, bytes_sent=sum(op["result_bytes"] for op in collectives))

  return _feedback.fixed_budget_transform(density, axis_name=AXIS, sparsify=sparsify)


# The floors' transformations, from the collectives of exdyna_network's step and the density.
FLOORS = {
    "exdyna_network_rounds": lambda collectives, density: rounds_only(collectives),
    "exdyna_network_two_rounds": lambda collectives, density: rounds_only(collectives[1:]),
    "exdyna_network_shell": shell_only,
}


def node_local_mesh() -> jax.sharding.Mesh:
  """A ``("node", "local")`` mesh: a row per process, its devices along ``"local"``."""
  devices = np.array(jax.devices()).reshape(jax.process_count(), jax.local_device_count())
  return jax.sharding.Mesh(devices, (NODE, LOCAL),
                           axis_types=(jax.sharding.AxisType.Auto,) * 2)


def hierarchical_step(tx, per_worker_step, params, batch):
  """``(train_step, opt_state, batch)`` on a `node_local_mesh`.

  The shard_map layout of docs/multihost.md: params replicated, the state
  and the batch split over both axes (each device's state with a leading
  axis of 1), gradients kept local (``check_vma=False``).
  """
  mesh = node_local_mesh()
  every = jax.P((NODE, LOCAL))

  def init(params):
    return jax.tree.map(lambda leaf: leaf[None], tx.init(params))

  def step(params, opt_state, batch):
    params, opt_state = per_worker_step(params, jax.tree.map(lambda s: s[0], opt_state), batch)
    return params, jax.tree.map(lambda leaf: leaf[None], opt_state)

  opt_state = jax.jit(jax.shard_map(init, mesh=mesh, in_specs=jax.P(), out_specs=every))(params)
  train_step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(jax.P(), every, every),
                                     out_specs=(jax.P(), every), check_vma=False),
                       donate_argnums=(0, 1))
  sharding = jax.sharding.NamedSharding(mesh, every)
  batch = tuple(jax.device_put(part, sharding) for part in batch)  # the same device order
  return train_step, opt_state, batch


def calibrate(mesh, sizes=(16, 4096, 65536, 1 << 20, 4 << 20), repeats: int = 5) -> list[dict]:
  """Median seconds of one ``psum`` and one ``all_gather`` of each size (bytes per worker)."""
  rows = []
  sharding = jax.sharding.NamedSharding(mesh, jax.P(AXIS))
  for kind, collective in (("all-reduce", lambda x: jax.lax.psum(x, AXIS)),
                           ("all-gather", lambda x: jax.lax.all_gather(x, AXIS, tiled=True))):
    fn = jax.jit(jax.shard_map(collective, mesh=mesh, in_specs=jax.P(AXIS),
                               out_specs=jax.P(AXIS), check_vma=False))
    for size in sizes:
      local = np.ones((jax.local_device_count() * size // 4,), np.float32)
      values = jax.make_array_from_process_local_data(sharding, local)
      jax.block_until_ready(fn(values))
      barrier()
      _, seconds = _common.blocked_seconds(lambda _, fn=fn, x=values: fn(x), None, repeats)
      op = {"kind": kind, "group": jax.device_count(),
            "result_bytes": size * (jax.device_count() if kind == "all-gather" else 1)}
      cost = hlo.ring_cost(op["kind"], op["result_bytes"], op["group"])
      rows.append({**op, **cost._asdict(), "seconds": float(np.median(seconds))})
  return rows


def collectives_of(train_step, *args) -> list[dict]:
  """The compiled step's collectives, each with its ring bytes and messages per worker."""
  text = train_step.lower(*args).compile().as_text()
  return [{"kind": op.kind, "result_bytes": op.result_bytes, "bytes": op.bytes_sent,
           "messages": op.messages, "log_messages": op.log_messages}
          for op in hlo.collectives(text, jax.device_count())]


def build_step(variant, mesh, params, batch, args, network=None, replayed=None):
  """``(train_step, opt_state, batch)`` of ``variant`` (``replayed``: what `FLOORS` replay)."""
  if variant in FLOORS:
    tx = optax.chain(FLOORS[variant](replayed, args.density), optax.sgd(args.learning_rate))
  else:
    tx = make_tx(variant, args.density, args.learning_rate, network)

  def per_worker_step(params, opt_state, batch):
    grads = jax.grad(tasks.mlp_loss)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  if variant in FAST_REDUCE:
    return hierarchical_step(tx, per_worker_step, params, batch)
  if VARIANTS[variant][0] is None:  # no sparsifier: data_parallel refuses that
    train_step = jax.jit(jax.shard_map(
        per_worker_step, mesh=mesh, in_specs=(jax.P(), jax.P(), jax.P(AXIS)),
        out_specs=(jax.P(), jax.P()), check_vma=False), donate_argnums=(0, 1))
    return train_step, tx.init(params), batch
  dp = exdyna_jax.data_parallel(tx, mesh, axis_name=AXIS)
  return dp.step(per_worker_step), dp.init(params), batch


def time_variant(variant, mesh, params, batch, args, network=None, replayed=None) -> dict:
  train_step, opt_state, batch = build_step(variant, mesh, params, batch, args, network, replayed)
  params = jax.tree.map(jnp.copy, params)  # donated below
  collectives = collectives_of(train_step, params, opt_state, batch)
  for _ in range(args.warmup):
    params, opt_state = jax.block_until_ready(train_step(params, opt_state, batch))
  barrier()  # every process starts the timed steps together
  begin = time.perf_counter()
  (params, opt_state), seconds = _common.blocked_seconds(
      lambda carry: train_step(*carry, batch), (params, opt_state), args.steps)
  elapsed = time.perf_counter() - begin
  # Without an exchange the processes drift apart (one may run alone a while):
  # the mean over steps that all processes run together is what compares.
  elapsed = max(elapsed, barrier(elapsed))
  result = {"variant": variant, "step_ms": [round(s * 1e3, 3) for s in seconds],
            "median_ms": round(float(np.median(seconds)) * 1e3, 3),
            "mean_ms": round(elapsed / args.steps * 1e3, 3), "collectives": collectives}
  if VARIANTS[variant][0] is not None:
    stats = exdyna_jax.get_stats(opt_state)
    result.update(transmitted=int(local_value(stats.transmitted)),
                  bytes_sent=int(local_value(stats.bytes_sent)))
  return result


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--variants", default=",".join(VARIANTS))
  parser.add_argument("--density", type=float, default=0.001)
  parser.add_argument("--features", type=int, default=256)
  parser.add_argument("--hidden", type=int, default=2048)
  parser.add_argument("--batch", type=int, default=32, help="examples per worker")
  parser.add_argument("--warmup", type=int, default=3)
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--learning-rate", type=float, default=0.01)
  parser.add_argument("--calibrate", action="store_true", help="time psum and all_gather first")
  args = parser.parse_args()

  mesh = make_mesh(jax.device_count())
  replicated = jax.sharding.NamedSharding(mesh, jax.P())
  sharded = jax.sharding.NamedSharding(mesh, jax.P(AXIS))

  sizes = (args.features, args.hidden, args.hidden, 10)
  initial = jax.tree.map(np.asarray, tasks.init_mlp(jax.random.key(0), sizes))
  params = jax.tree.map(lambda v: put(v, replicated), initial)
  rng = np.random.default_rng(1)
  examples = args.batch * jax.device_count()
  batch = (put(rng.normal(size=(examples, args.features)).astype(np.float32), sharded),
           put(rng.integers(0, 10, size=examples).astype(np.int32), sharded))
  num_params = sum(v.size for v in jax.tree.leaves(params))
  if args.calibrate:
    rows = calibrate(mesh)
    if jax.process_index() == 0:
      print(json.dumps({"calibration": rows}), flush=True)
  variants = args.variants.split(",")
  measured = [v for v in variants if VARIANTS[v][1].get("network") == "measure"]
  replaying = bool(FLOORS.keys() & set(variants))
  network = exdyna_jax.Network.measure(mesh, AXIS) if measured or replaying else None
  replayed = None
  if replaying:
    step, opt_state, _ = build_step("exdyna_network", mesh, params, batch, args, network)
    replayed = collectives_of(step, params, opt_state, batch)
  for variant in variants:
    result = time_variant(variant, mesh, params, batch, args, network, replayed)
    if jax.process_index() == 0:
      result.update(processes=jax.process_count(), devices=jax.device_count(),
                    parameters=num_params, density=args.density)
      if variant in measured:
        result["network"] = list(network)
      print(json.dumps(result), flush=True)


if __name__ == "__main__":
  main()
