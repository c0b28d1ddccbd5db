"""The launcher's emulated cluster: every process behind its own shaped link.

`python -m exdyna_jax.launch --link-rate RATE` runs each process in a network
namespace of its own, its link shaped both ways. These tests run it the way
a user does (the command line, 2 processes of one CPU device) and check that
collectives are right, that a transfer takes at least the time its bytes
need at the link rate, and that nothing of the network outlives the run on
any exit path: success, a worker killed, a timeout, Ctrl-C. Without the
privileges the launcher refuses with a message that says what to do.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from exdyna_jax.launch import _shaped_links
from tests import subprocesses

pytestmark = pytest.mark.slow  # the tools end to end: `-m "not slow"` leaves them out

WORKER = str(Path(__file__).with_name("shaped_links_worker.py"))
HARD_TIMEOUT = 90.0  # seconds per launcher run; a healthy one takes ~5 s
# Runs its arguments (a program and its own) with SIGINT at its default disposition.
SIGINT_DEFAULT = [sys.executable, "-c", "import os, signal, sys; "
                  "signal.signal(signal.SIGINT, signal.SIG_DFL); "
                  "os.execv(sys.argv[1], sys.argv[1:])"]


def _can_make_namespaces() -> bool:
  if any(shutil.which(tool) is None for tool in _shaped_links.TOOLS):
    return False
  probe = "import ctypes, sys; sys.exit(ctypes.CDLL(None).unshare(0x40000000) != 0)"
  return subprocess.run([sys.executable, "-c", probe], check=False).returncode == 0


needs_namespaces = pytest.mark.skipif(
    not _can_make_namespaces(), reason="needs root (or a user namespace) and ip, tc, nsenter"
)


def _start_launcher(*args: str, worker_args=(), prefix=()) -> subprocess.Popen:
  command = [*prefix, sys.executable, "-m", "exdyna_jax.launch", "--processes=2",
             "--init-timeout=30", "--heartbeat-timeout=10", *args, "--",
             sys.executable, WORKER, *worker_args]
  return subprocesses.start(command)


def _reports(proc: subprocess.Popen, count: int = 2) -> list[dict]:
  """Reads the workers' JSON lines as they come (the run goes on)."""
  reports = []
  deadline = time.monotonic() + HARD_TIMEOUT
  while len(reports) < count and time.monotonic() < deadline:
    line = proc.stdout.readline()
    if not line:
      break
    if "{" in line:
      reports.append(json.loads(line[line.index("{"):]))
  return sorted(reports, key=lambda report: report["rank"])


def _finish(proc: subprocess.Popen) -> tuple[int, str]:
  code, _, err, _ = subprocesses.finish(proc, HARD_TIMEOUT)
  return code, err


def _leftovers(launcher_pid: int, namespaces: set[str]) -> list[str]:
  """Processes still in the run's namespaces, and the run's hub if it still runs."""
  hub = f"{_shaped_links.HUB_NAME}-of-{launcher_pid}"
  found = []
  for entry in Path("/proc").iterdir():
    if not entry.name.isdigit():
      continue
    try:
      namespace = os.readlink(entry / "ns" / "net")
      cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
      continue  # gone meanwhile
    if namespace in namespaces or hub in cmdline:
      found.append(f"{entry.name}: {cmdline} in {namespace}")
  return found


def _assert_nothing_left(proc: subprocess.Popen, reports: list[dict]) -> None:
  namespaces = {report["namespace"] for report in reports}
  assert len(namespaces) == 2 and os.readlink("/proc/self/ns/net") not in namespaces
  assert _leftovers(proc.pid, namespaces) == []


def test_rates_are_parsed_in_tcs_notation():
  assert _shaped_links.parse_rate("1gbit") == 10**9
  assert _shaped_links.parse_rate(" 2.5Mbit ") == 2_500_000
  assert _shaped_links.parse_rate("unshaped") is None
  assert _shaped_links.link_rates("1gbit,100mbit", 2) == [10**9, 10**8]
  assert _shaped_links.link_rates("100mbit", 3) == [10**8] * 3
  assert _shaped_links.format_rate(10**8) == "100mbit"
  for bad in ("1gb", "fast", "-1gbit", "1kbit"):
    with pytest.raises(ValueError, match="kbit"):
      _shaped_links.parse_rate(bad)
  with pytest.raises(ValueError, match="one rate for all, or one each"):
    _shaped_links.link_rates("1gbit,1gbit", 3)


def test_a_bad_rate_is_a_usage_error():
  proc = _start_launcher("--link-rate=1gigabit")
  code, err = _finish(proc)
  assert code == 2 and "is not a number with a unit of tc's" in err, err


@needs_namespaces
def test_collectives_are_right_and_take_their_bandwidth_bound():
  megabytes, rate = 1.0, 50_000_000
  proc = _start_launcher(f"--link-rate={_shaped_links.format_rate(rate)}",
                         worker_args=[f"--megabytes={megabytes}"])
  reports = _reports(proc)
  code, err = _finish(proc)
  assert code == 0, err[-3000:]
  assert [report["psum"] for report in reports] == [3.0, 3.0]  # 1 + 2 on both
  # Each process receives the other's megabyte: 168 ms at 50 Mbit/s, less
  # the token bucket's burst the link may send at once.
  bound = (megabytes * 2**20 - _shaped_links._burst_bytes(rate)) * 8 / rate
  for report in reports:
    assert report["gather_seconds"] >= bound, (report, bound)
  _assert_nothing_left(proc, reports)


@needs_namespaces
def test_a_killed_worker_stops_the_run_and_leaves_no_namespace():
  proc = _start_launcher("--link-rate=1gbit,100mbit", worker_args=["--then=die"])
  reports = _reports(proc)
  code, err = _finish(proc)
  assert code == 128 + signal.SIGKILL, err[-3000:]
  assert "rank 1 killed by signal 9" in err
  _assert_nothing_left(proc, reports)


@needs_namespaces
def test_a_timeout_stops_the_run_and_leaves_no_namespace():
  proc = _start_launcher("--link-rate=1gbit", "--timeout=6",
                         worker_args=["--then=hang", "--report-first"])
  reports = _reports(proc)
  code, err = _finish(proc)
  assert code == 124, err[-3000:]
  _assert_nothing_left(proc, reports)


@needs_namespaces
def test_ctrl_c_stops_the_run_and_leaves_no_namespace():
  # A suite started as a shell's background job (`cmd &`) inherits SIGINT
  # ignored, and so would the launcher, as any program does: start it with
  # the default disposition, as from a terminal.
  proc = _start_launcher("--link-rate=1gbit", worker_args=["--then=hang"],
                         prefix=SIGINT_DEFAULT)
  reports = _reports(proc)
  caught = [line for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines()
            if line.startswith(("SigIgn", "SigCgt"))]
  os.kill(proc.pid, signal.SIGINT)
  code, err = _finish(proc)
  assert code == 130, f"{len(reports)} reports, {caught}\n{err[-3000:]}"
  assert "interrupted" in err
  _assert_nothing_left(proc, reports)


@needs_namespaces
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux)")
def test_without_the_privileges_the_launcher_says_what_to_do():
  drop = ("setpriv", "--bounding-set=-net_admin,-sys_admin")  # root without those two
  proc = _start_launcher("--link-rate=1gbit", prefix=drop)
  code, err = _finish(proc)
  assert code == 2, err[-3000:]
  assert "Operation not permitted" in err and "unshare --user --map-root-user" in err
  assert "Without --link-rate" in err
  assert _leftovers(proc.pid, set()) == []


def _start_cluster_demo(run_dir: Path, *args: str, prefix=()) -> subprocess.Popen:
  return subprocesses.start([*prefix, sys.executable, "-m", "exdyna_jax", "demo",
                             "--processes=2", "--link-rate=1gbit", "--task=digits",
                             "--steps=10", "--eval-every=5", f"--run-dir={run_dir}", *args])


@needs_namespaces
def test_the_demo_on_shaped_links_times_each_method_to_denses_accuracy(tmp_path):
  code, out, err, _ = subprocesses.finish(
      _start_cluster_demo(tmp_path, "--network=measure"), HARD_TIMEOUT)
  assert code == 0, err[-3000:]
  saved = json.loads((tmp_path / "runs.json").read_text())
  dense, exdyna = saved["runs"]
  # The workers timed the network once, before training: at most the link's rate
  # (its token bucket's burst aside), and a message costs something.
  seconds, bytes_per_second = exdyna["network"]
  assert dense["network"] == exdyna["network"] and saved["config"]["network"] == "measure"
  assert 0 < seconds < 0.1 and 1e7 < bytes_per_second < 1.5e9 / 8
  assert "ExDyna told the network (measured)" in out
  assert (dense["variant"], exdyna["variant"], saved["link_rate"]) == ("dense", "exdyna", "1gbit")
  assert dense["steps"] == 10 and [point[1] for point in dense["curve"]] == [5, 10]
  # ExDyna trains for dense's seconds, so its last evaluation comes at or after them,
  # its schedule planned over the steps that fit them (dense's at least).
  assert exdyna["curve"][-1][0] >= dense["seconds"] > 0
  assert dense["planned_steps"] == 10 <= exdyna["planned_steps"]
  assert exdyna["bytes_sent"] * 20 < dense["bytes_sent"]
  assert all(0 < point[3] < exdyna["num_elements"] for point in exdyna["curve"])
  header, *rows = [line for line in out.splitlines() if line.startswith(("method", "dense ",
                                                                          "exdyna "))]
  assert header.split()[:4] == ["method", "steps", "step", "ms"] and len(rows) == 2
  assert max(len(line) for line in out.splitlines()) <= 100
  assert (tmp_path / "time_to_accuracy.png").stat().st_size > 0


@needs_namespaces
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux)")
def test_the_demo_without_the_privileges_says_how_to_run_it(tmp_path):
  drop = ("setpriv", "--bounding-set=-net_admin,-sys_admin")
  code, _, err, _ = subprocesses.finish(_start_cluster_demo(tmp_path, prefix=drop), HARD_TIMEOUT)
  assert code == 2, err[-3000:]
  assert "unshare --user --map-root-user" in err and "Without --processes" in err
  assert "Traceback" not in err


@pytest.mark.parametrize("args, message", [
    (["--link-rate=1gbit"], "--link-rate needs --processes"),
    (["--processes=2", "--link-rate=1gbit,1gbit,1gbit"], "3 link rates for 2 processes"),
    (["--processes=1"], "must be an integer >= 2"),
])
def test_a_bad_cluster_demo_option_is_a_usage_error(args, message):
  result = subprocess.run([sys.executable, "-m", "exdyna_jax", "demo", *args],
                          capture_output=True, text=True, timeout=60, check=False)
  assert result.returncode == 2 and message in result.stderr
