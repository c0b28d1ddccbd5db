"""The target row under several ``XLA_FLAGS``, interleaved, in one call (for `benchmarks.gpu`).

XLA reads ``XLA_FLAGS`` once, when its backend starts, so each setting runs
``benchmarks.gpu --target-only`` in a process of its own; the settings take
turns, ``rounds`` times, so that a drift of the machine falls on all of them
alike. An empty setting is XLA's defaults (``XLA_FLAGS`` unset).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile

from benchmarks import _common


def compare(settings, methods, rounds, extra_args=(), out=None):
  """Runs the target row under each setting of ``XLA_FLAGS``, ``rounds`` times in turn.

  Args:
    settings: ``XLA_FLAGS`` strings ("" for XLA's defaults).
    methods: what ``--methods`` each run times.
    rounds: how many times each setting runs.
    extra_args: further arguments of every run (``--quick``, ``--repeats 5``).
    out: where the JSON goes (default ``results/gpu_flags.json``).

  Returns:
    ``{"settings": [...], "runs": [{"xla_flags", "round", "rows": {method:
    {"seconds", "queued_seconds", "dispatch_seconds"}}, "exdyna_over_floor"}]}``,
    in the order run (a run that failed: ``{"xla_flags", "round", "error"}``),
    also written to ``out``.
  """
  runs = []
  with tempfile.TemporaryDirectory() as scratch:
    for number in range(rounds):
      for flags in settings:
        row_out = pathlib.Path(scratch) / f"{number}-{len(runs)}.json"
        env = {key: value for key, value in os.environ.items() if key != "XLA_FLAGS"}
        env.update({"XLA_FLAGS": flags} if flags else {})
        done = subprocess.run([sys.executable, "-m", "benchmarks.gpu", "--target-only",
                               "--methods", ",".join(methods), "--out", str(row_out),
                               *extra_args], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
        if done.returncode:  # a setting XLA refuses: say so, and go on with the others
          runs.append({"xla_flags": flags, "round": number, "error": done.stderr[-2000:]})
          print(f"[{flags}] failed: {done.stderr[-300:]}", file=sys.stderr, flush=True)
          continue
        row = json.loads(row_out.read_text())["rows"][0]
        runs.append({"xla_flags": flags, "round": number,
                     "rows": {name: {key: row[name][key]
                                     for key in ("seconds", "queued_seconds", "dispatch_seconds")}
                              for name in methods},
                     "exdyna_over_floor": row["exdyna_over_floor"]})
        print(table_line(runs[-1]), file=sys.stderr, flush=True)
  result = {"settings": list(settings), "runs": runs}
  (out or _common.RESULTS / "gpu_flags.json").write_text(json.dumps(result, indent=1) + "\n")
  return result


def table_line(run):
  """One run as a line: its flags, ExDyna over the floor, each method's blocked / queued /
  dispatch ms."""
  timings = " ".join(f"{name} {1e3 * row['seconds']:.3f}/{1e3 * row['queued_seconds']:.3f}/"
                     f"{1e3 * row['dispatch_seconds']:.3f}" for name, row in run["rows"].items())
  return f"[{run['xla_flags'] or 'defaults'}] x{run['exdyna_over_floor']:.2f} {timings}"
