"""Update time per step of one configuration: ExDyna vs dense psum, the floor, Top-k.

Run: python -m benchmarks.update_cost [--elements N] [--density D] [--workers n]
     [--repeats R] [--methods exdyna,dense,topk_ef]

A single configuration of the cost grid in ``cost.py`` (same programs, same
interleaved timing), printed as JSON. The full grid and the report:
``python -m benchmarks.run``.
"""

from __future__ import annotations

import argparse
import json

from benchmarks import _common, cost


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--elements", type=int, default=_common.RESNET18)
  parser.add_argument("--density", type=float, default=0.001)
  parser.add_argument("--workers", type=int, default=8)
  parser.add_argument("--repeats", type=int, default=7)
  parser.add_argument("--warmup-steps", type=int, default=3)
  parser.add_argument("--methods", default="exdyna,dense,topk_ef")
  args = parser.parse_args()
  config = {
    "elements": args.elements,
    "workers": args.workers,
    "density": args.density,
    "methods": args.methods.split(","),
  }
  result = cost.measure(config, args.repeats, args.warmup_steps)
  report = {
    key: result[key] for key in ("elements", "workers", "density", "median_seconds", "ratios")
  }
  report["stats"] = result["stats"]
  print(json.dumps(report, indent=2))


if __name__ == "__main__":
  main()
