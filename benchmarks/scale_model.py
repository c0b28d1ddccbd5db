"""Alpha-beta model of communication time per step, from the compiled programs.

Run: python -m benchmarks.scale_model [--traffic FILE] [--out FILE]

**One level** (``predictions``). For each method, density and ``n`` (8 to
1024 workers, each compiled for real in ``traffic.py``), the time of one
step's collectives is predicted as

    T = sum over the step's collectives of  messages * alpha + bytes * 8 / B

with ``bytes`` and ``messages`` per worker from the ring model of `exdyna_jax.hlo`.
Each op takes the faster of two algorithms with the same bytes (for powers
of two), as MPI and NCCL pick by message size: the ring (``2 (g-1)``
messages for an all-reduce, ``g - 1`` for an all-gather) and the
latency-optimal one (Rabenseifner / recursive doubling / Bruck: ``2 log2 g``
and ``log2 g``). ``seconds_ring`` keeps the ring-only prediction.

Assumptions: one worker per host on a non-blocking network whose per-host link
of ``B`` bit/s is the bottleneck (full duplex, sends and receives overlap);
``alpha`` = 5 us per message (host-to-host latency of MPI/NCCL-class
transports on RDMA or tuned TCP; try ``--alpha``); collectives of one step
run one after the other, nothing overlaps with compute; no compression of
the index lists; float32 values and int32 indices, as compiled.

**Two levels** (``two_level``). ``H`` hosts of ``L`` devices (``n = H L``;
``L`` = 4 and 8, ``n`` up to 1024), as `exdyna_jax.hierarchical` runs them
on a ``("node", "local")`` mesh. Per step:

* inside a host (``B_intra``, ``alpha_intra``): ``psum`` mode all-reduces
  the ``4N``-byte gradient; ``scatter`` mode reduce-scatters it and
  all-gathers the slices' updates (the same ``2 (L-1)/L * 4N`` bytes per
  device, the same message count) plus a one-scalar all-reduce. Each op
  takes the faster of ring and latency-optimal, as above.
* between hosts (``B`` = the host's network link, ``alpha`` = 5 us): the
  method's compiled collectives for ``n = H`` workers (the ``traffic.py``
  row of ``H``), run by each of the host's ``L`` devices at once, so the
  host link carries ``L`` times one device's bytes while the latency is that
  of one exchange. In ``psum`` mode every device exchanges the whole
  vector's payload; in ``scatter`` mode a slice of ``N / L`` elements, so
  the payload ops' bytes are divided by ``L`` (the index buffers and value
  vectors are proportional to ``k``, hence to the slice's size; HLO of the
  real programs, ``docs/multihost.md``: 3.72x to 4.00x less at
  ``L = 4``). Control ops (results of at most 64 bytes: the step's count
  ``psum``, ExDyna's ``s32[9]`` workload counts) keep their size; the
  smallest payload op in the compiled programs is 80 bytes.
* ``dense`` in ``scatter`` mode is the hierarchical all-reduce
  (reduce-scatter in the host, all-reduce of the ``N / L`` shard across
  hosts, all-gather in the host), checked against its closed form.
* intra-host links: ``nvlink`` = 300 GB/s, 3 us per message (NVLink-class
  servers); ``pcie`` = 25 GB/s, 5 us (PCIe 4.0 x16, GPUs without NVLink).
  One network link of ``B`` per host, shared by its ``L`` devices (a VM with
  one NIC; with one NIC per GPU divide the inter-host byte term by ``L``).
  The intra- and inter-host phases run one after the other; no overlap
  with compute or between phases.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from benchmarks import _common

LINKS_GBPS = (10, 25, 100, 400)
ALPHA_SECONDS = 5e-6
LOCAL_DEVICES = (4, 8)
MAX_DEVICES = 1024
# name -> (bytes per second, seconds per message) of the links inside a host.
INTRA_LINKS = {"nvlink": (300e9, 3e-6), "pcie": (25e9, 5e-6)}
CONTROL_BYTES = 64  # ops with results this small do not scale with the slice


def predict(row: dict, link_gbps: float, alpha: float, latency: str = "best") -> float:
  """Seconds per step of ``row``'s collectives on a ``link_gbps`` link.

  ``latency``: ``"ring"`` (ring message counts), ``"log"`` (latency-optimal
  counts) or ``"best"`` (the faster of the two, op by op).
  """
  per_byte = 8 / (link_gbps * 1e9)
  total = 0.0
  for op in row["ops"]:
    ring = op["messages"] * alpha + op["bytes"] * per_byte
    log = op["log_messages"] * alpha + op["bytes"] * per_byte
    total += {"ring": ring, "log": log, "best": min(ring, log)}[latency]
  return total


def model(traffic: dict, alpha: float) -> list[dict]:
  """Predictions for every measured ``(method, density, n >= 8)``."""
  out = []
  for row in traffic["rows"]:
    if row["workers"] < 8:
      continue
    entry = {
      "method": row["method"],
      "density": row["density"],
      "workers": row["workers"],
      "bytes": row["bytes"],
      "messages": row["messages"],
      "log_messages": row["log_messages"],
      "seconds": {},
      "seconds_ring": {},
    }
    for link in LINKS_GBPS:
      entry["seconds"][str(link)] = predict(row, link, alpha)
      entry["seconds_ring"][str(link)] = predict(row, link, alpha, "ring")
    out.append(entry)
  return out


def _best_messages(op: dict) -> float:
  return min(op["messages"], op["log_messages"])


def _collective_seconds(kind: str, group: int, size: float, bandwidth: float, alpha: float):
  """``(seconds, bytes per device)`` of one collective of ``size`` result bytes.

  ``bandwidth`` in bytes per second; faster of ring and latency-optimal.
  """
  if group <= 1:
    return 0.0, 0.0
  rounds = math.ceil(math.log2(group))
  if kind == "all-reduce":
    sent, messages = 2 * (group - 1) / group * size, min(2 * (group - 1), 2 * rounds)
  elif kind == "reduce-scatter":  # ``size``: the result per device
    sent, messages = (group - 1) * size, min(group - 1, rounds)
  else:  # all-gather, ``size``: the gathered result
    sent, messages = (group - 1) / group * size, min(group - 1, rounds)
  return messages * alpha + sent / bandwidth, sent


def intra_host(mode: str, elements: int, local: int, bandwidth: float, alpha: float):
  """``(seconds, bytes per device)`` of the dense phase inside one host."""
  size = 4.0 * elements
  if mode == "psum":
    return _collective_seconds("all-reduce", local, size, bandwidth, alpha)
  width = math.ceil(elements / local)
  parts = [
    _collective_seconds("reduce-scatter", local, 4.0 * width, bandwidth, alpha),
    _collective_seconds("all-gather", local, 4.0 * width * local, bandwidth, alpha),
    _collective_seconds("all-reduce", local, 4.0, bandwidth, alpha),  # non-finite screen
  ]
  return sum(p[0] for p in parts), sum(p[1] for p in parts)


def inter_host(row: dict, mode: str, local: int, link_gbps: float, alpha: float):
  """``(seconds, bytes on the host's link)`` of ``L`` devices' exchanges of ``row``."""
  per_byte = 8 / (link_gbps * 1e9)
  seconds, host_bytes = 0.0, 0.0
  for op in row["ops"]:
    sent = op["bytes"]
    if mode == "scatter" and op["result_bytes"] > CONTROL_BYTES:
      sent /= local  # the payload of an N / L slice
    seconds += _best_messages(op) * alpha + local * sent * per_byte
    host_bytes += local * sent
  return seconds, host_bytes


def hierarchical_allreduce_seconds(
  elements: int, hosts: int, local: int, link_gbps: float, alpha: float, intra: tuple
) -> float:
  """Closed form of the hierarchical dense all-reduce (checks ``dense`` / scatter)."""
  bandwidth, intra_alpha = intra
  width = math.ceil(elements / local)
  inside = _collective_seconds("reduce-scatter", local, 4.0 * width, bandwidth, intra_alpha)[0]
  inside += _collective_seconds("all-gather", local, 4.0 * width * local, bandwidth, intra_alpha)[0]
  across, _ = _collective_seconds("all-reduce", hosts, 4.0 * width, link_gbps * 1e9 / 8, alpha)
  # the host's L devices run their shards' all-reduces at once over one link
  across += (local - 1) * 2 * (hosts - 1) / hosts * 4.0 * width * 8 / (link_gbps * 1e9)
  return inside + across


def two_level(traffic: dict, alpha: float) -> list[dict]:
  """Hierarchical predictions for every method, density, ``L``, ``H`` and mode."""
  elements = traffic["elements"]
  rows = {(r["method"], r["density"], r["workers"]): r for r in traffic["rows"]}
  out = []
  for (method, density, hosts), row in sorted(rows.items()):
    for local in LOCAL_DEVICES:
      if hosts < 2 or hosts * local > MAX_DEVICES:
        continue
      for mode in ("psum", "scatter"):
        for intra, (bandwidth, intra_alpha) in INTRA_LINKS.items():
          inside, intra_bytes = intra_host(mode, elements, local, bandwidth, intra_alpha)
          entry = {
            "method": method,
            "density": density,
            "hosts": hosts,
            "local": local,
            "workers": hosts * local,
            "mode": mode,
            "intra": intra,
            "intra_bytes_per_device": intra_bytes,
            "intra_seconds": inside,
            "seconds": {},
          }
          for link in LINKS_GBPS:
            across, host_bytes = inter_host(row, mode, local, link, alpha)
            entry["inter_bytes_per_host"] = host_bytes
            entry["seconds"][str(link)] = inside + across
          if method == "dense" and mode == "scatter":
            for link in LINKS_GBPS:
              closed = hierarchical_allreduce_seconds(
                elements, hosts, local, link, alpha, INTRA_LINKS[intra]
              )
              # the row adds the step's scalar count psum; nothing else differs
              assert abs(entry["seconds"][str(link)] - closed) <= 0.01 * closed + 2e-4, (
                entry,
                closed,
              )
          out.append(entry)
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--traffic", default=str(_common.RESULTS / "traffic.json"))
  parser.add_argument("--alpha", type=float, default=ALPHA_SECONDS)
  parser.add_argument("--out", default=str(_common.RESULTS / "scale_model.json"))
  args = parser.parse_args()
  with open(args.traffic) as f:
    traffic = json.load(f)
  _common.write_json(
    args.out,
    {
      "benchmark": "scale_model",
      "alpha_seconds": args.alpha,
      "links_gbps": list(LINKS_GBPS),
      "elements": traffic["elements"],
      "predictions": model(traffic, args.alpha),
      "two_level": {
        "local_devices": list(LOCAL_DEVICES),
        "intra_links": {
          name: {"bytes_per_second": bw, "alpha_seconds": a}
          for name, (bw, a) in INTRA_LINKS.items()
        },
        "control_bytes": CONTROL_BYTES,
        "predictions": two_level(traffic, args.alpha),
      },
    },
  )


if __name__ == "__main__":
  sys.exit(main())
