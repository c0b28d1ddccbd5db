"""Several JAX processes on 127.0.0.1 (jax.distributed, CPU devices, gloo).

Every run goes through a subprocess with a hard timeout that SIGKILLs its
whole process group (the launcher's workers also die with the launcher), so
no test can hang:

* 2 processes x 2 CPU devices reproduce the single-process 4-device run of
  the same ExDyna steps (shard_map path and `data_parallel` under jit);
* an orbax checkpoint that 2 processes save together resumes, in 2 fresh
  processes, exactly as the uninterrupted run goes on (and in 1 process with
  4 devices, to float rounding);
* a process that never joins, or dies mid-run, makes the others exit with a
  clear error within a bounded time, with and without the launcher.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import numpy as np
import pytest

from exdyna_jax import launch
from tests.subprocesses import finish as _finish
from tests.subprocesses import start as _start

pytestmark = pytest.mark.slow  # the tools end to end: `-m "not slow"` leaves them out

WORKER = str(Path(__file__).with_name("multihost_worker.py"))
CHECKPOINT_WORKER = str(Path(__file__).with_name("multihost_checkpoint_worker.py"))


def _launcher(
    processes, devices, *worker_args, init_timeout=30, heartbeat=10, timeout=120, worker=WORKER
):
  command = [
      sys.executable,
      "-m",
      "exdyna_jax.launch",
      f"--processes={processes}",
      f"--devices-per-process={devices}",
      f"--init-timeout={init_timeout}",
      f"--heartbeat-timeout={heartbeat}",
      f"--timeout={timeout}",
      "--",
      sys.executable,
      worker,
      *worker_args,
  ]
  return _start(command)


def test_two_processes_reproduce_the_single_process_run(tmp_path):
  single_out, multi_out = tmp_path / "single.npz", tmp_path / "multi.npz"
  runs = [_launcher(1, 4, str(single_out)), _launcher(2, 2, str(multi_out))]
  results = [_finish(proc) for proc in runs]
  for code, _, err, _ in results:
    assert code == 0, err[-3000:]
  _, out, _, _ = results[1]
  assert "[rank 0] process 0/2: 2 local of 4 devices" in out
  assert "[rank 1] process 1/2: 2 local of 4 devices" in out
  assert "[rank 1] done" in out

  single, multi = np.load(single_out), np.load(multi_out)
  for name in ("updates_w", "updates_b", "residual", "dp_w"):
    np.testing.assert_allclose(multi[name], single[name], rtol=1e-6, atol=1e-6, err_msg=name)
  np.testing.assert_allclose(multi["dp_losses"], single["dp_losses"], rtol=1e-6, atol=1e-6)
  for name in (
      "threshold",
      "selected",
      "transmitted",
      "workloads",
      "partition_starts",
      "partition_sizes",
      "dp_thresholds",
  ):
    np.testing.assert_array_equal(multi[name], single[name], err_msg=name)

  # The run is not trivial: ExDyna sent something and moved its partitions,
  # and the updates are identical on every worker.
  assert np.all(single["selected"] > 0)
  sizes = single["partition_sizes"][0]
  assert len({tuple(row) for row in sizes}) > 1
  np.testing.assert_array_equal(multi["updates_w"], multi["updates_w"][:1].repeat(4, 0))


def test_checkpoint_saved_by_two_processes_resumes_exactly(tmp_path):
  """Save with orbax from 2 processes; resume in fresh processes; compare."""
  saved, resumed, single = (tmp_path / f"{name}.npz" for name in ("save", "resume", "single"))
  directory = str(tmp_path / "checkpoint")

  def checkpoint_run(processes, devices, phase, out):
    return _launcher(processes, devices, phase, directory, str(out), worker=CHECKPOINT_WORKER)

  code, out, err, _ = _finish(checkpoint_run(2, 2, "save", saved))
  assert code == 0, err[-3000:]
  assert "[rank 0] save done" in out and "[rank 1] save done" in out
  # Both processes wrote their own shards; process 0 committed the checkpoint.
  state_dir = tmp_path / "checkpoint" / "state"
  assert {p.name for p in state_dir.glob("ocdbt.process_*")} == {
      "ocdbt.process_0",
      "ocdbt.process_1",
  }
  assert (state_dir / "commit_success.txt").exists()

  # Fresh processes: 2 x 2 as saved, and 1 x 4 (the same 4-device mesh).
  runs = [checkpoint_run(2, 2, "resume", resumed), checkpoint_run(1, 4, "resume", single)]
  for code, _, err, _ in [_finish(proc) for proc in runs]:
    assert code == 0, err[-3000:]
  expected, got, other = np.load(saved), np.load(resumed), np.load(single)
  assert expected.files == got.files == other.files
  for name in expected.files:  # restored state, every later update, stats, final state
    np.testing.assert_array_equal(got[name], expected[name], err_msg=name)
    if name.startswith(("threshold", "selected", "partition")):
      np.testing.assert_array_equal(other[name], expected[name], err_msg=name)
    else:
      np.testing.assert_allclose(other[name], expected[name], rtol=1e-6, atol=1e-6, err_msg=name)

  # Not vacuous: at the checkpoint the block estimate the partitions are cut
  # from had left its start (1/16 each), the residuals and the momentum were
  # non-zero; afterwards ExDyna sent every step and w moved.
  assert not np.allclose(expected["checkpoint_block_workloads"], 1 / 16, rtol=1e-3)
  assert np.all(np.abs(expected["checkpoint_residual"]).sum(axis=1) > 0)
  assert np.abs(expected["checkpoint_momentum_w"]).sum() > 0
  assert np.all(expected["selected"] > 0)
  assert not np.array_equal(expected["final_w"], expected["checkpoint_w"])


def test_a_process_that_never_joins_fails_the_run():
  proc = _launcher(2, 2, "unused.npz", "--hang-rank=1", init_timeout=4)
  code, out, err, elapsed = _finish(proc, timeout=90)
  assert code != 0
  assert "[rank 1] never joining" in out
  # Rank 0 gives up on its own after the initialization timeout; the launcher
  # then kills the process that never joined.
  assert "DEADLINE_EXCEEDED" in err, err[-3000:]
  assert "[launch] rank 0" in err
  assert elapsed < 60


def test_a_process_that_dies_stops_the_launcher():
  proc = _launcher(2, 2, "unused.npz", "--die-at=0", "--die-rank=1")
  code, out, err, elapsed = _finish(proc, timeout=90)
  assert code == 17, err[-3000:]
  assert "[rank 1] dying at step 0" in out
  assert "[launch] rank 1 exited with code 17; stopping the 1 process(es)" in err
  assert elapsed < 60


@pytest.mark.parametrize("dying", [1, 0])  # 0 also hosts the coordination service
def test_survivor_exits_on_its_own_when_a_process_dies(dying):
  """Without the launcher, the heartbeat of jax.distributed stops the survivor."""
  env = dict(
      os.environ,
      JAX_PLATFORMS="cpu",
      **{
          launch.COORDINATOR_ENV: f"127.0.0.1:{launch.free_port()}",
          launch.NUM_PROCESSES_ENV: "2",
          launch.DEVICES_PER_PROCESS_ENV: "2",
          launch.INIT_TIMEOUT_ENV: "30",
          launch.HEARTBEAT_TIMEOUT_ENV: "3",
      },
  )
  procs = [
      _start(
          [sys.executable, WORKER, "unused.npz", "--die-at=0", f"--die-rank={dying}"],
          env={**env, launch.PROCESS_ID_ENV: str(rank)},
      )
      for rank in range(2)
  ]
  results = [_finish(proc, timeout=90) for proc in procs]
  assert results[dying][0] == 17
  code, _, err, _ = results[1 - dying]
  assert code != 0
  assert "Terminating process because the JAX distributed service detected fatal errors" in err
  if dying == 1:
    assert "stopped sending heartbeats" in err


def test_launcher_rejects_bad_arguments():
  with pytest.raises(ValueError, match="at least 1"):
    launch.launch(["true"], processes=0)
  with pytest.raises(ValueError, match="No command"):
    launch.launch([], processes=1)
  with pytest.raises(ValueError, match="needs EXDYNA_PROCESS_ID"):
    launch.initialize_from_env({launch.NUM_PROCESSES_ENV: "2"})
  with pytest.raises(ValueError, match="outside"):
    launch.initialize_from_env(
        {
            launch.NUM_PROCESSES_ENV: "2",
            launch.PROCESS_ID_ENV: "2",
            launch.COORDINATOR_ENV: "127.0.0.1:1",
        }
    )
  assert launch.initialize_from_env({}) is False
  assert launch.parse_args(["--processes=3", "--", "python", "-c", "1"]).command == [
      "python",
      "-c",
      "1",
  ]
  with pytest.raises(SystemExit):
    launch.parse_args(["--processes=2"])  # no command
  for bad in (["--processes=0"], ["--devices-per-process=-1"]):
    with pytest.raises(SystemExit):  # a usage error, not a traceback
      launch.parse_args([*bad, "--", "python", "-c", "1"])


def test_a_command_that_does_not_exist_is_named_with_exit_127(capsys):
  assert launch.main(["--processes=2", "--", "no-such-command-exdyna"]) == 127
  assert "command not found: 'no-such-command-exdyna'" in capsys.readouterr().err


# A jitted program whose 58 MB temporary is allocated at every execution;
# prints the page faults of each of 15 executions after two.
REALLOCATE = """
import resource
import jax, jax.numpy as jnp
run = jax.jit(lambda x: jnp.cumsum(x)[::7].sum())
x = jnp.ones(12_000_000)
for _ in range(2):
  run(x).block_until_ready()
faults = []
for _ in range(15):
  before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  run(x).block_until_ready()
  faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print("faults", *faults)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_workers_reuse_the_memory_a_step_frees():
  """XLA:CPU allocates a program's temporaries at every execution: in a
  launched worker (`launch.CPU_MALLOC_TUNABLES`) most executions get them
  back without page faults, where glibc's defaults map them afresh every
  time (14,000 faults an execution here). Now and then an execution still
  faults while the heap settles (about one in eight here, up to three of
  nine in a row), so the test asks for a quarter of them to be fault-free,
  not for all. A GLIBC_TUNABLES of the user's own is kept. The executions
  are what is measured, so they run XLA's own code generation, not the
  suite's cheaper one (five times slower to run here)."""
  faults = {}
  for tunables in (None, ""):
    env = dict(os.environ)
    env.pop("GLIBC_TUNABLES", None)
    env.pop("XLA_FLAGS", None)
    if tunables is not None:
      env["GLIBC_TUNABLES"] = tunables
    output = io.StringIO()
    code = launch.launch([sys.executable, "-c", REALLOCATE], processes=1, env=env,
                         stdout=output, stderr=output)
    assert code == 0, output.getvalue()
    line = next(line for line in output.getvalue().splitlines() if " faults " in line)
    faults[tunables] = [int(count) for count in line.split(" faults ")[1].split()]
  reused = {tunables: sum(count < 1_000 for count in counts) for tunables, counts in faults.items()}
  assert reused[None] >= 4, faults  # at least a quarter of the 15 executions
  assert reused[""] == 0, faults  # glibc's defaults: every execution faults anew


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity is Linux's")
@pytest.mark.parametrize("processes", [1, 3])  # fewer or more processes than two CPUs
def test_pinned_processes_keep_to_their_share_of_the_cpus(processes):
  """Each process's threads run on its own CPUs: equal parts of the launcher's, or one each
  in turn where the processes outnumber them; the variable that says so does not leak."""
  cpus = sorted(os.sched_getaffinity(0))[:2]
  command = [sys.executable, "-c", "import os; print('cpus', sorted(os.sched_getaffinity(0)), "
             "os.environ.get('EXDYNA_CPUS'), os.environ['EXDYNA_PROCESS_ID'])"]
  output = io.StringIO()
  with mock.patch("os.sched_getaffinity", return_value=set(cpus)):
    code = launch.launch(command, processes=processes, pin_cpus=True, stdout=output,
                         stderr=output)
  assert code == 0, output.getvalue()
  seen = {int(line.split()[-1]): line.split("cpus ")[1].rsplit(" ", 2)[0]
          for line in output.getvalue().splitlines() if " cpus " in line}
  expected = {1: [cpus], 3: [[cpus[0]], [cpus[1 % len(cpus)]], [cpus[0]]]}[processes]
  assert seen == {rank: str(share) for rank, share in enumerate(expected)}, output.getvalue()
  assert "None" in output.getvalue() and "EXDYNA_CPUS" not in output.getvalue()


def test_launcher_timeout_kills_everything():
  command = [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(600)"]
  output = io.StringIO()
  start = time.monotonic()
  code = launch.launch(command, processes=2, timeout=2.0, stdout=output, stderr=output)
  assert code == launch.TIMEOUT_EXIT_CODE
  assert time.monotonic() - start < 20
  text = output.getvalue()
  assert "[rank 0] up" in text and "[rank 1] up" in text
  assert "[launch] timeout after 2 s; killing ranks [0, 1]" in text


def _gone(pid: int) -> bool:
  try:
    with open(f"/proc/{pid}/status") as status:
      return any(line.split()[:2] == ["State:", "Z"] for line in status)  # zombie: dead
  except FileNotFoundError:
    return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux")
def test_workers_die_with_the_launcher():
  """A hard kill of the launcher (as a test timeout does) takes its workers along."""
  command = "import os, time; print('pid', os.getpid(), flush=True); time.sleep(600)"
  launcher = [sys.executable, "-m", "exdyna_jax.launch", "--processes=2", "--timeout=60"]
  proc = subprocess.Popen(
      [*launcher, "--", sys.executable, "-c", command],
      stdout=subprocess.PIPE,
      stderr=subprocess.DEVNULL,
      start_new_session=True,
      text=True,
  )
  pids = []
  try:
    deadline = time.monotonic() + 60
    while len(pids) < 2 and time.monotonic() < deadline:
      line = proc.stdout.readline()
      if " pid " in line:
        pids.append(int(line.split()[-1]))
    assert len(pids) == 2
  finally:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
  deadline = time.monotonic() + 10
  while not all(_gone(pid) for pid in pids) and time.monotonic() < deadline:
    time.sleep(0.1)
  assert all(_gone(pid) for pid in pids)


class _Exits:
  """A worker process stand-in: ``poll()`` is None until ``after`` seconds, then ``code``."""

  def __init__(self, code, after):
    self.code, self.at = code, time.monotonic() + after

  def poll(self):
    return self.code if time.monotonic() >= self.at else None


def test_a_rank_that_exits_0_early_is_named(monkeypatch):
  """Rank 1 leaves with 0 while rank 0 runs on (and later aborts, waiting for it): the
  launcher says which rank left, and the abort's message points there."""
  from exdyna_jax.launch import _processes

  monkeypatch.setattr(_processes, "EARLY_EXIT_GRACE", 0.2)
  said = []
  code = _processes.wait([_Exits(-6, 0.6), _Exits(0, 0.0)], timeout=10, say=said.append)
  assert code == 128 + 6
  assert len(said) == 2 and said[0].startswith("rank(s) [1] exited with 0")
  assert said[1].startswith("rank 0 killed by signal 6 (after rank(s) [1] had exited with 0")
  said.clear()  # a healthy run whose ranks finish apart within the grace: nothing said
  assert _processes.wait([_Exits(0, 0.1), _Exits(0, 0.0)], timeout=10, say=said.append) == 0
  assert said == []


def test_a_script_started_by_slurm_or_mpirun_joins_the_run(monkeypatch):
  """Without EXDYNA_* variables, Slurm's or Open MPI's own make initialize_from_env call
  jax.distributed.initialize() (which reads the ranks from them) and check the count."""
  import jax

  calls = []
  monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **k: calls.append((a, k)))
  monkeypatch.setattr(jax, "process_count", lambda: 4)
  assert launch.initialize_from_env({"SLURM_NTASKS": "4", "SLURM_PROCID": "2"}) is True
  assert launch.initialize_from_env({"OMPI_COMM_WORLD_SIZE": "4"}) is True
  assert calls == [((), {}), ((), {})]
  assert launch.initialize_from_env({"SLURM_NTASKS": "1", "SLURM_PROCID": "0"}) is False
  assert len(calls) == 2  # one task: a single process, nothing joined
  monkeypatch.setattr(jax, "process_count", lambda: 1)
  with pytest.raises(RuntimeError, match=r"Slurm started 4 tasks, but jax\.distributed found 1 "
                                         r"process\(es\): each would train alone"):
    launch.initialize_from_env({"SLURM_NTASKS": "4", "SLURM_PROCID": "2"})
