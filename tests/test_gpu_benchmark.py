"""benchmarks/gpu.py runs (here on CPU, ``--quick``) and writes what the GPU issue asks for."""

from __future__ import annotations

import gzip
import itertools
import json
import math
import pathlib
import re
import subprocess

import jax
import jax.numpy as jnp

from benchmarks import _gpu_against_cpu, _gpu_profile, _gpu_programs, _gpu_timing, _gpu_train, gpu

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
      assert row[name]["seconds"] > 0 and row[name]["queued_seconds"] > 0, name
      # The call returns before the step ends, or as it ends: never after.
      assert 0 < row[name]["dispatch_seconds"] <= 2 * row[name]["seconds"], name
    assert row["exdyna_over_floor"] == row["exdyna"]["seconds"] / row["floor_bandwidth_seconds"]
    assert row["exdyna"]["sent_over_k"] > 0
    # Five steps from the initial threshold: the default never sends more than
    # its ceil(1.1 k) value slots.
    assert row["exdyna"]["sent_over_k"] <= 1.1 + 1 / (0.001 * row["elements"])


def test_quick_train_step_times_every_method(tmp_path):
  out = tmp_path / "gpu.json"
  gpu.main(["--quick", "--repeats", "1", "--out", str(out), "--methods", "exdyna,topk_ef,floor",
            "--train"])
  train = json.loads(out.read_text())["train"]
  layers = _gpu_train.QUICK_TRAIN_LAYERS
  assert train["parameters"] == sum(a * b + b for a, b in itertools.pairwise(layers))
  for name in _gpu_train.TRAIN_METHODS:
    assert train[name]["seconds"] > 0, name


def test_against_cpu_compares_the_indices_sent_and_the_updates_of_each_method():
  """``--against-cpu`` here compares the CPU with itself: the same indices, no difference."""
  result = _gpu_against_cpu.against_cpu(0.01, methods=("topk", "exdyna_reference"))
  assert result["elements"] == 201_216 and result["steps"] == _gpu_against_cpu.STEPS
  for name in ("topk", "exdyna_reference"):
    assert result[name] == {"transmitted_equal": True, "update_relative_difference": 0.0,
                            "state_relative_difference": 0.0}, name
  assert gpu.gpt_methods("compute,exdyna@0.001,topk_union@0.01") == [
      ("compute", None), ("exdyna", 0.001), ("topk_union", 0.01)]
  assert gpu.gpt_methods(None) == _gpu_train.GPT_METHODS


def test_the_gpt_has_85m_parameters_and_starts_at_the_uniform_loss():
  """The GPT of ``--gpt``: 12 blocks of 12 d^2 weights and two norms, the byte
  embedding (tied to the output) and the positions; at initialisation it
  predicts about uniformly over 256 bytes."""
  config = _gpu_train.GPT
  shapes = jax.eval_shape(lambda: _gpu_train.init_gpt(jax.random.key(0), **config))
  width = config["width"]
  expected = (config["layers"] * (12 * width**2 + 2 * width)
              + (config["vocab"] + config["context"] + 1) * width)
  assert sum(math.prod(x.shape) for x in jax.tree.leaves(shapes)) == expected == 85_347_072
  quick = _gpu_train.QUICK_GPT
  params = _gpu_train.init_gpt(jax.random.key(0), **quick)
  tokens = jax.random.randint(jax.random.key(1), (2, quick["context"] + 1), 0, quick["vocab"])
  loss = _gpu_train.gpt_loss(params, tokens, quick["heads"])
  assert abs(float(loss) - math.log(quick["vocab"])) < 0.05


def test_profile_summary_names_each_kernel_and_where_it_came_from(tmp_path):
  """`_gpu_profile.busiest_operations` reads a trace's device threads; `with_sources` finds the
  Python frame XLA recorded for each operation in the compiled HLO."""
  def scaled_sum(x):
    return jnp.sum(x * 3.0)

  hlo = jax.jit(scaled_sum).lower(jnp.ones(1000)).compile().as_text()
  fusion = re.search(r"%(\w+fusion[\w.]*) = ", hlo)[1]
  events = [
      {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
      {"ph": "M", "pid": 1, "tid": 7, "name": "thread_name", "args": {"name": "Stream #7"}},
      {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/host:CPU"}},
      *({"ph": "X", "pid": 1, "tid": 7, "name": fusion.replace(".", "_"), "ts": 10.0 * i,
         "dur": 4.0} for i in range(6)),
      {"ph": "X", "pid": 1, "tid": 7, "name": "MemcpyD2H", "ts": 60.0, "dur": 1.0},
      {"ph": "X", "pid": 2, "tid": 3, "name": "host work", "ts": -50.0, "dur": 300.0},
  ]
  with gzip.open(tmp_path / "host.trace.json.gz", "wt") as file:
    json.dump({"traceEvents": events}, file)
  summary = _gpu_profile.with_sources(_gpu_profile.busiest_operations(tmp_path, steps=2), hlo)
  (thread,) = summary.values()  # the host's thread is left out
  assert thread["events_per_step"] == 3.5 and thread["busy_us_per_step"] == 12.5
  # The device's span (0 to 61 us) includes its idle gaps; each D2H copy is a wait.
  assert thread["span_us_per_step"] == 30.5 and thread["device_to_host_per_step"] == 0.5
  (everything,) = json.loads((tmp_path / "operations.json").read_text()).values()
  assert [op["name"] for op in everything] == [fusion.replace(".", "_"), "MemcpyD2H"]
  top = thread["top"][0]
  assert (top["count_per_step"], top["us_per_step"]) == (3, 12)
  assert top["source"].startswith("test_gpu_benchmark.py:") and "scaled_sum" in top["source"]


def test_xla_flags_settings_take_turns_each_in_a_process_of_its_own(tmp_path, monkeypatch):
  """``--compare-xla-flags``: each setting runs the target row in a fresh process
  (``XLA_FLAGS`` is read once, at start), the settings in turn, an empty one with
  ``XLA_FLAGS`` unset; the JSON holds every run's timings in the order run, and
  the error of a setting XLA refuses, without stopping the others."""
  calls = []

  def fake_run(command, env, **_):
    calls.append((env.get("XLA_FLAGS"), command))
    if env.get("XLA_FLAGS") == "--xla_refused=1":
      return subprocess.CompletedProcess(command, 1, stderr="Unknown flag in XLA_FLAGS")
    out = pathlib.Path(command[command.index("--out") + 1])
    seconds = 1e-3 * len(calls)
    row = {name: {"seconds": seconds, "queued_seconds": seconds / 2,
                  "dispatch_seconds": seconds / 4} for name in ("exdyna", "topk_ef", "floor")}
    out.write_text(json.dumps({"rows": [{**row, "exdyna_over_floor": 2.0 + len(calls)}]}))
    return subprocess.CompletedProcess(command, 0, stderr="")

  monkeypatch.setenv("XLA_FLAGS", "--inherited")
  monkeypatch.setattr(gpu._gpu_flags.subprocess, "run", fake_run)
  out = tmp_path / "flags.json"
  gpu.main(["--compare-xla-flags=|--xla_a=1|--xla_refused=1", "--rounds", "2", "--repeats", "3",
            "--methods", "exdyna,topk_ef,floor", "--out", str(out)])
  assert [flags for flags, _ in calls] == [None, "--xla_a=1", "--xla_refused=1"] * 2
  assert all(command[1:4] == ["-m", "benchmarks.gpu", "--target-only"]
             and command[-2:] == ["--repeats", "3"] for _, command in calls)
  result = json.loads(out.read_text())
  assert result["settings"] == ["", "--xla_a=1", "--xla_refused=1"]
  assert [(run["xla_flags"], run["round"]) for run in result["runs"]] == [
      (flags, number) for number in (0, 1) for flags in result["settings"]]
  timed = [run for run in result["runs"] if "error" not in run]
  assert [run["rows"]["exdyna"]["seconds"] for run in timed] == [1e-3, 2e-3, 4e-3, 5e-3]
  assert [run["rows"]["floor"]["dispatch_seconds"] for run in timed] == [
      2.5e-4, 5e-4, 1e-3, 1.25e-3]
  refused = [run for run in result["runs"] if "error" in run]
  assert [run["error"] for run in refused] == ["Unknown flag in XLA_FLAGS"] * 2


def test_unchecked_diagnostic_drops_only_the_misfit_checks_host_callback():
  """``exdyna_unchecked`` traces ExDyna without the check of a state that does not fit
  (its conditional's host callback); ``exdyna`` keeps it."""
  callbacks = {}
  for name in ("exdyna", "exdyna_unchecked"):
    with _gpu_timing.traced_as(name):
      state, run = _gpu_programs.vmapped_update(name, 4096, 0.01)
      text = run.lower(state, jnp.ones((_gpu_timing.WORKERS, 4096))).as_text()
    callbacks[name] = text.count("callback")
  assert callbacks == {"exdyna": 1, "exdyna_unchecked": 0}
