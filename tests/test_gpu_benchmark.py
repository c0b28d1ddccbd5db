"""benchmarks/gpu.py runs (here on CPU, ``--quick``) and writes what the GPU issue asks for."""

from __future__ import annotations

import json
import math
import pathlib

from benchmarks import gpu

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_quick_run_writes_the_ratios_and_the_table(tmp_path):
  out = tmp_path / "gpu.json"
  # The step itself is tested elsewhere; compiling micro and the reference
  # controller too would only repeat that here.
  methods = ["exdyna", "topk_ef", "floor"]
  gpu.main(["--quick", "--repeats", "2", "--out", str(out), "--methods", ",".join(methods)])
  result = json.loads(out.read_text())
  assert result["device"] and result["quick"] is True
  for key in ("exdyna_over_floor", "topk_over_exdyna"):
    assert math.isfinite(result[key]) and result[key] > 0, key
  assert [(r["elements"], r["density"]) for r in result["rows"]] == gpu.QUICK_GRID
  for row in result["rows"]:
    for name in methods:
      assert row[name]["seconds"] > 0, name
    assert row["exdyna"]["sent_over_k"] > 0
    # Five steps from the initial threshold: the default never sends more than
    # its ceil(1.1 k) value slots.
    assert row["exdyna"]["sent_over_k"] <= 1.1 + 1 / (0.001 * row["elements"])
