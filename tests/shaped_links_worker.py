"""A worker of `tests/test_shaped_links.py`, started by the launcher with shaped links.

Prints one JSON line: its network namespace, the psum of every process's
``rank + 1``, and the seconds one all-gather of ``--megabytes`` MB per
process took (the median of three). With ``--then`` it afterwards kills
itself (``die``: rank 1, once both have reported) or sleeps (``hang``) so
the test can stop the launcher.
With ``--report-first`` it prints its rank and namespace before JAX starts
(for a test whose launcher times out: a busy machine can take longer than
that to start JAX), and no line after.
"""

import argparse
import json
import os
import signal
import time

parser = argparse.ArgumentParser()
parser.add_argument("--megabytes", type=float, default=0.0)
parser.add_argument("--then", choices=("exit", "die", "hang"), default="exit")
parser.add_argument("--report-first", action="store_true")
args = parser.parse_args()
if args.report_first:
  print(json.dumps({"rank": int(os.environ["EXDYNA_PROCESS_ID"]),
                    "namespace": os.readlink("/proc/self/ns/net")}), flush=True)

from exdyna_jax import launch  # noqa: E402

launch.initialize_from_env()

import jax  # noqa: E402
import numpy as np  # noqa: E402

mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
rank = jax.process_index()
sharding = jax.sharding.NamedSharding(mesh, jax.P("data"))


def distributed(local):
  return jax.make_array_from_process_local_data(sharding, np.asarray(local)[None])


def collective(fn):
  return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=jax.P("data"), out_specs=jax.P()))


total_of_ranks = collective(lambda x: jax.lax.psum(x, "data"))
total = total_of_ranks(distributed([rank + 1.0]))
report = {
    "rank": rank,
    "namespace": os.readlink("/proc/self/ns/net"),
    "psum": float(np.asarray(total.addressable_data(0)).reshape(-1)[0]),
}
if args.megabytes:
  values = distributed(np.random.default_rng(rank).random(int(args.megabytes * 2**18), np.float32))
  gather = collective(lambda x: jax.lax.all_gather(x, "data", to="invarying").sum(0))
  jax.block_until_ready(gather(values))
  seconds = []
  for _ in range(3):
    start = time.perf_counter()
    jax.block_until_ready(gather(values))
    seconds.append(time.perf_counter() - start)
  report["gather_seconds"] = float(np.median(seconds))
if not args.report_first:
  print(json.dumps(report), flush=True)
if args.then == "die":
  # One more all-reduce: rank 1 gets past it only once rank 0 has printed its line.
  jax.block_until_ready(total_of_ranks(distributed([rank + 1.0])))
  os.kill(os.getpid(), signal.SIGKILL) if rank == 1 else time.sleep(60)
elif args.then == "hang":
  time.sleep(60)
