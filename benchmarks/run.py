"""Regenerates every benchmark result and the report, in one command.

Run: python -m benchmarks.run [--quick] [--only traffic,cost,...] [--results DIR]

Each part runs in its own process (they force different CPU device counts):

==================  ==========================================================
traffic             collectives of the compiled step per method and n (HLO),
                    memory analysis (``traffic.py``, compile only, n <= 1024)
scale_model         alpha-beta prediction from those bytes (``scale_model.py``)
collectives         CPU alpha-beta fit and replay check (``collectives.py``)
density_control     K/k, imbalance and overflow over training
training_options    density warm-up and bf16 values: accuracy and bytes
                    (``training_options.py``)
profile             static pass count and timing variants (``profile_update.py``)
optimizer_state     momentum and Adam after the sparsifier: step, temporaries,
                    weight copies (``optimizer_state.py``)
cost                update time grid, inside a time budget (``cost.py``)
cluster             the train step and time to accuracy over shaped links
                    (``cluster.py``; needs root, about an hour: only run
                    when named, ``--only cluster,report``)
cluster_lm          the language model's time to dense's test loss over
                    shaped links, per step and with local steps
                    (``cluster_lm.py``; root, about 30 minutes: only run
                    when named); cluster_lm_code: the same on Python's source
language_model      a byte-level transformer: test loss, bytes and time to
                    dense's loss per exchange (``language_model.py``; about
                    30 minutes: only run when named); language_model_code:
                    the same on a second corpus (Python's source), fewer runs;
                    language_model_5m: a 5.6M-parameter model (about 4 hours)
report              ``REPORT.md`` and plots (``report.py``)
==================  ==========================================================

The default suite takes about 25 minutes on 2 cores; ``--quick`` (about 5) runs
small versions and writes to a scratch directory unless ``--results`` says
otherwise. Results (JSON, ``REPORT.md``, ``*.png``) go to
``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import pathlib
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
PARTS = (
  "traffic",
  "scale_model",
  "collectives",
  "density_control",
  "training_options",
  "profile",
  "optimizer_state",
  "cost",
  "cluster",
  "cluster_lm",
  "cluster_lm_code",
  "language_model",
  "language_model_code",
  "language_model_5m",
  "report",
)
# Only when named: root and an hour; root and twenty minutes; half an hour to hours.
DEFAULT_PARTS = tuple(part for part in PARTS if part not in (
    "cluster", "cluster_lm", "cluster_lm_code", "language_model", "language_model_code",
    "language_model_5m"))


# The second corpus: the baseline and the references, per-step ExDyna both ways and Top-k,
# DiLoCo, local steps.
CODE_CORPUS_VARIANTS = ("ddp,sparse_adamw_dense,sparse_adamw_oracle@0.01,exdyna@0.01,"
                        "sparse_adamw@0.01,sparse_adamw_topk_steered@0.00125,"
                        "diloco@10,local@10@0.25,local_topk@10@0.05,ddp:900,"
                        "sparse_adamw@0.01:900,sparse_adamw_topk_steered@0.00125:900,"
                        "sparse_adamw_topk_steered@0.00125@2xlr,"
                        "sparse_adamw_topk_steered@0.00125@2xlr:900")
# The 5.6M-parameter model (width 256, 7 blocks, dense AdamW's peak 3e-3): dense at two rates,
# the AdamW recipe at three and its reference, per-step ExDyna both ways, DiLoCo, local steps.
LARGE_MODEL = ["--width", "256", "--layers", "7", "--learning-rate", "3e-3"]
LARGE_MODEL_VARIANTS = ("ddp,ddp@0.5xlr,sparse_adamw_dense,exdyna@0.01,sparse_adamw@0.01,"
                        "sparse_adamw_topk_steered@0.00125,sparse_adamw_topk_steered@0.00125@2xlr,"
                        "sparse_adamw_topk_steered@0.00125@0.5xlr,"
                        "sparse_adamw_topk_steered@0.000125,diloco@10,diloco@30,local@10@1.0,"
                        "local_topk@10@0.05,local@30@0.05@bf16,local_chunked_topk@10@1.0@2ar2,"
                        "ddp:900,ddp@0.5xlr:900,sparse_adamw_topk_steered@0.00125:900")


def commands(results: pathlib.Path, quick: bool, cost_budget: float) -> dict[str, list[str]]:
  """The command line of every part."""
  q = ["--quick"] if quick else []
  out = {name: ["--out", str(results / f"{name}.json")] for name in PARTS}
  traffic = ["--traffic", str(results / "traffic.json")]
  density = ["--steps", "60", "--densities", "0.01"] if quick else []
  return {
    "traffic": ["traffic", *q, *out["traffic"]],
    "scale_model": ["scale_model", *traffic, *out["scale_model"]],
    "collectives": ["collectives", *q, *traffic, *out["collectives"]],
    "density_control": ["density_control", *density, *out["density_control"]],
    "training_options": ["training_options", *q, *out["training_options"]],
    "profile": ["profile_update", *q, *out["profile"]],
    "optimizer_state": ["optimizer_state", *q, *out["optimizer_state"]],
    "cost": ["cost", *q, "--budget", str(cost_budget), *out["cost"]],
    "cluster": ["cluster", *q, *out["cluster"]],
    "cluster_lm": ["cluster_lm", *out["cluster_lm"]],
    "cluster_lm_code": ["cluster_lm", "--task", "lm-code", *out["cluster_lm_code"]],
    "language_model": ["language_model", *q, *out["language_model"]],
    "language_model_code": ["language_model", *q, "--corpus", "code", "--variants",
                            CODE_CORPUS_VARIANTS, *out["language_model_code"]],
    "language_model_5m": ["language_model", *q, *LARGE_MODEL, "--variants",
                          LARGE_MODEL_VARIANTS, *out["language_model_5m"]],
    "report": ["report", "--results", str(results)],
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--quick", action="store_true", help="small smoke versions")
  parser.add_argument("--only", default=",".join(DEFAULT_PARTS), help="comma-separated parts")
  parser.add_argument("--results", default=None, help="output directory")
  parser.add_argument("--cost-budget", type=float, default=780.0, help="seconds for the grid")
  args = parser.parse_args()
  default = pathlib.Path("/tmp/exdyna_benchmarks_quick") if args.quick else HERE / "results"
  results = pathlib.Path(args.results) if args.results else default
  results.mkdir(parents=True, exist_ok=True)
  wanted = [p.strip() for p in args.only.split(",") if p.strip()]
  unknown = set(wanted) - set(PARTS)
  if unknown:
    parser.error(f"unknown parts {sorted(unknown)}; choose from {', '.join(PARTS)}")
  cmds = commands(results, args.quick, args.cost_budget)
  start = time.perf_counter()
  failed = []
  for part in PARTS:
    if part not in wanted:
      continue
    module, *rest = cmds[part]
    print(f"== {part} ({time.perf_counter() - start:.0f}s)", file=sys.stderr, flush=True)
    code = subprocess.call([sys.executable, "-m", f"benchmarks.{module}", *rest], cwd=HERE.parent)
    if code:
      failed.append(part)
      print(f"!! {part} failed with exit code {code}", file=sys.stderr, flush=True)
  print(
    f"== done in {time.perf_counter() - start:.0f}s; results in {results}"
    + (f"; FAILED: {', '.join(failed)}" if failed else ""),
    file=sys.stderr,
  )
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
