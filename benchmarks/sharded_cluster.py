"""`sharded_step`'s tensor-parallel MLP across worker processes: the data axis between them.

Run under the launcher, one process per data worker and the ``model`` axis
inside each (gloo collectives between the processes; ``--link-rate`` shapes
the link, as root):

  python -m exdyna_jax.launch --processes 2 --devices-per-process 2 \\
      [--link-rate 1gbit] -- python -m benchmarks.sharded_cluster [--axis-type Auto]

Process 0 prints one JSON line per method: the median blocked step over
``--steps`` steps after 3 warm-up steps, the run's sent/k and bytes a step,
and the parameters' shardings after the run. The methods: ``dense`` and
``exdyna`` (d = 0.01) on the tensor-parallel model, and ``hierarchical``
(``hierarchical(exdyna(0.01))`` with the model replicated: every device a
worker, the gradient reduce-scattered inside a process and each slice
sparsified across the processes).
"""

from __future__ import annotations

import argparse
import json
import time

from exdyna_jax.launch import initialize_from_env


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--axis-type", choices=("Explicit", "Auto"), default="Explicit")
  parser.add_argument("--steps", type=int, default=10)
  args = parser.parse_args(argv)
  initialize_from_env()
  import jax
  import numpy as np
  import optax
  from jax import P

  import exdyna_jax
  from benchmarks.sharded_step import BATCH, DENSITY, SPECS, D, H, loss_fn

  kind = getattr(jax.sharding.AxisType, args.axis_type)
  devices = np.array(jax.devices()).reshape(jax.process_count(), -1)  # a row per process
  mesh = jax.sharding.Mesh(devices, ("data", "model"), axis_types=(kind, kind))
  place = lambda value, spec: jax.make_array_from_callback(  # noqa: E731
      value.shape, jax.NamedSharding(mesh, spec), lambda index: value[index])
  rng = np.random.default_rng(0)
  host = {"w1": rng.normal(size=(D, H)).astype(np.float32) / np.sqrt(D),
          "w2": rng.normal(size=(H, D)).astype(np.float32) / np.sqrt(H),
          "b": np.zeros(D, np.float32)}
  x = rng.normal(size=(BATCH, D)).astype(np.float32)
  sparsifiers = {
      "dense": exdyna_jax.dense(), "exdyna": exdyna_jax.exdyna(DENSITY),
      "hierarchical": exdyna_jax.hierarchical(exdyna_jax.exdyna(DENSITY, axis_name="data"),
                                              fast_axis="model")}
  for method, sparsifier in sparsifiers.items():
    workers = ("data", "model") if method == "hierarchical" else "data"
    specs = SPECS if method != "hierarchical" else dict.fromkeys(SPECS, P())
    params = {name: place(value, specs[name]) for name, value in host.items()}
    batch = (place(x, P(workers)), place(x, P(workers)))
    tx = optax.chain(sparsifier, optax.sgd(0.1))
    dp = exdyna_jax.data_parallel(tx, mesh, axis_name=workers)

    @dp.step
    def step(params, opt_state, batch, tx=tx):
      updates, opt_state = tx.update(jax.grad(loss_fn)(params, batch), opt_state, params)
      return optax.apply_updates(params, updates), opt_state

    opt_state = dp.init(params)
    times = []
    for i in range(3 + args.steps):
      start = time.perf_counter()
      params, opt_state = step(params, opt_state, batch)
      jax.block_until_ready((params, opt_state))
      times.append(time.perf_counter() - start) if i >= 3 else None
    totals = exdyna_jax.read_totals(dp.stats(opt_state))
    if jax.process_index() == 0:
      print(json.dumps({
          "axis_type": args.axis_type, "method": method, "processes": jax.process_count(),
          "step_ms": round(1e3 * float(np.median(times)), 1),
          "sent_over_k": round(totals["transmitted"] / totals["target"], 3),
          "bytes_per_step": totals["bytes_sent"] // totals["steps"],
          "shardings": {name: str(leaf.sharding.spec) for name, leaf in params.items()}}),
          flush=True)


if __name__ == "__main__":
  main()
