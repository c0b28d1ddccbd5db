"""The language model on the emulated cluster: time to dense's test loss, per step and local.

Runs ``exdyna-jax demo --processes 4 --task lm --link-rate RATE`` as a user
does, once per link rate and recipe: each run trains dense for 200 steps,
then every other method for dense's seconds (its schedule over the steps
that fit them), and says when each first reached dense's final test loss.
The recipes (`recipes`): the per-step AdamW recipes at 1 % (`topk_union`,
ExDyna, and ``chunked_topk_2bit``: ``6 d / n`` in 2 bits after its density
warm-up), and local steps of AdamW with every element in 2 bits on a
quantized all-reduce every ``H`` steps (``--method chunked_topk --density 1
--value-bits 2 --wire all_reduce --sync-every H``).

Run as root (network namespaces): ``python -m benchmarks.cluster_lm
[--rates 100mbit 1gbit] [--sync-every 10 100] [--task lm-code]`` (about 30 minutes); writes
``results/cluster_lm.json`` (``--out``), every run's curve included.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks import _common

PER_STEP = ["--method", "topk_union", "exdyna", "chunked_topk_2bit"]
TWO_BIT_ALL_REDUCE = ["--method", "chunked_topk", "--density", "1", "--value-bits", "2",
                      "--wire", "all_reduce"]


def recipes(sync_every: list[int]) -> dict[str, list[str]]:
  """``{label: demo arguments}``: the per-step recipes, then local steps at each ``H``."""
  local = {f"local steps, H = {h}": [*TWO_BIT_ALL_REDUCE, "--sync-every", str(h)]
           for h in sync_every}
  return {"per step, d = 0.01": PER_STEP, **local}


def demo_runs(task: str, rate: str, arguments: list[str], eval_every: int) -> dict:
  """One ``exdyna-jax demo --processes 4`` run: its ``runs.json`` and its command line."""
  with tempfile.TemporaryDirectory() as run_dir:
    command = ["exdyna-jax", "demo", "--processes", "4", "--task", task, "--link-rate", rate,
               "--eval-every", str(eval_every), "--no-plots", *arguments]
    subprocess.run([sys.executable, "-m", "exdyna_jax", *command[1:], "--run-dir", run_dir],
                   check=True)
    return {"command": " ".join(command), **json.loads((Path(run_dir) / "runs.json").read_text())}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--rates", nargs="+", default=["100mbit", "1gbit"])
  parser.add_argument("--sync-every", nargs="+", type=int, default=[10, 100])
  parser.add_argument("--task", default="lm", choices=("lm", "lm-code"))
  parser.add_argument("--eval-every", type=int, default=25)
  parser.add_argument("--out", default=str(_common.RESULTS / "cluster_lm.json"))
  args = parser.parse_args()
  invocations = []
  for rate in args.rates:
    for label, arguments in recipes(args.sync_every).items():
      _common.log(f"{rate}: {label}")
      invocations.append({"recipe": label, **demo_runs(args.task, rate, arguments,
                                                       args.eval_every)})
  _common.write_json(args.out, {"task": args.task, "invocations": invocations})


if __name__ == "__main__":
  main()
