"""Alpha-beta model of communication time per step, from the compiled programs.

Run: python benchmarks/scale_model.py [--traffic FILE] [--out FILE]

For each method, density and ``n`` (8 to 1024 workers, each compiled for
real in ``traffic.py``), the time of one step's collectives is predicted as

    T = sum over the step's collectives of  messages * alpha + bytes * 8 / B

with ``bytes`` and ``messages`` per worker from the ring model of `_hlo`.
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
"""

from __future__ import annotations

import argparse
import json
import sys

import _common

LINKS_GBPS = (10, 25, 100, 400)
ALPHA_SECONDS = 5e-6


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
    },
  )


if __name__ == "__main__":
  sys.exit(main())
