"""Worker processes that die with the launcher, optionally in namespaces of their own.

Every process the launcher starts runs a short bootstrap first (a fresh,
single-threaded interpreter): it asks Linux to SIGKILL it when the launcher
dies (``PR_SET_PDEATHSIG``, on Linux; workers lead their own sessions, so killing the
launcher's process group, as a test's hard timeout does, would not reach
them otherwise), keeps to the CPUs `CPUS_ENV` names if it is set (every
thread the command starts inherits them), then becomes the worker's
command. A process that gets a network of its own (`_shaped_links`) first
enters new network and UTS namespaces, takes its host name, tells the
launcher, and waits until the launcher has wired its link. (A
``preexec_fn`` would do the same before exec, but is unsafe in a
multithreaded parent.)
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence

SETUP_TIMEOUT = 30.0  # seconds for a new process to enter its namespaces
TIMEOUT_EXIT_CODE = 124
CPUS_ENV = "EXDYNA_CPUS"  # the CPUs a process keeps to, comma-separated; read by the bootstrap

# argv: launcher pid, then (fd to say "ready", fd to wait on, host name) or
# three empty strings, then the command.
_BOOTSTRAP = f"""
import ctypes, os, signal, sys
libc = ctypes.CDLL(None, use_errno=True)
if sys.platform.startswith("linux"):
  libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
  if os.getppid() != int(sys.argv[1]):  # the launcher died before prctl
    sys.exit(137)
if cpus := os.environ.pop({CPUS_ENV!r}, ""):
  os.sched_setaffinity(0, [int(cpu) for cpu in cpus.split(",")])
if sys.argv[4]:  # Linux only
  ready, wired, name = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].encode()
  if libc.unshare(0x40000000 | 0x04000000) or libc.sethostname(name, len(name)):  # NET, UTS
    os.write(ready, b"E%d" % ctypes.get_errno())
    sys.exit(126)
  os.write(ready, b"R")
  os.close(ready)
  if os.read(wired, 1) != b"G":  # the launcher gave up
    sys.exit(125)
  os.close(wired)
os.execvp(sys.argv[5], sys.argv[5:])
"""


def cpu_shares(processes: int, cpus: Sequence[int]) -> list[list[int]]:
  """Each process's share of ``cpus``: equal contiguous parts, or one each in turn if fewer.

  Example:
    >>> cpu_shares(2, [0, 1, 2, 3]), cpu_shares(4, [0, 1])
    ([[0, 1], [2, 3]], [[0], [1], [0], [1]])
  """
  if processes > len(cpus):
    return [[cpus[rank % len(cpus)]] for rank in range(processes)]
  return [list(cpus[rank * len(cpus) // processes:(rank + 1) * len(cpus) // processes])
          for rank in range(processes)]


def start(command: Sequence[str], **popen_kwargs) -> subprocess.Popen:
  """Starts ``command`` in a process group of its own that dies with this process.

  Args:
    command: the program and its arguments.
    **popen_kwargs: passed to `subprocess.Popen` (``env``, ``stdout``, ...).

  Returns:
    The `subprocess.Popen`.
  """
  return _bootstrap(command, ("", "", ""), **popen_kwargs)


def _bootstrap(command: Sequence[str], setup: Sequence[str], **popen_kwargs) -> subprocess.Popen:
  """Popen of `_BOOTSTRAP` with its set-up arguments, leading a process group of its own."""
  return subprocess.Popen(
      [sys.executable, "-c", _BOOTSTRAP, str(os.getpid()), *setup, *command],
      start_new_session=True,  # its own process group: killed as a whole
      **popen_kwargs,
  )


def start_isolated(
    command: Sequence[str],
    hostname: str,
    wire: Callable[[int], None],
    *,
    privileges_hint: str,
    setup_timeout: float = SETUP_TIMEOUT,
    **popen_kwargs,
) -> subprocess.Popen:
  """`start`, in new network and UTS namespaces, once ``wire(pid)`` has set its network up.

  Args:
    command: the program and its arguments.
    hostname: the process's host name in its UTS namespace.
    wire: called with the process id once it is in its namespaces, before
      ``command`` runs; if it raises, the process exits without running it.
    privileges_hint: what to do, for the `PermissionError`.
    setup_timeout: seconds the process may take to enter its namespaces.
    **popen_kwargs: passed to `subprocess.Popen`.

  Returns:
    The `subprocess.Popen`, running ``command``. Where ``wire`` or the
    set-up fails, the process is killed before the error propagates.

  Raises:
    PermissionError: when the namespaces cannot be made (with ``privileges_hint``).
    RuntimeError: when the process does not enter them in time.
  """
  ready_read, ready_write = os.pipe()
  wired_read, wired_write = os.pipe()
  proc = None
  try:
    proc = _bootstrap(command, (str(ready_write), str(wired_read), hostname),
                      pass_fds=(ready_write, wired_read), **popen_kwargs)
    os.close(ready_write)
    ready_write = None
    readable, _, _ = select.select([ready_read], [], [], setup_timeout)
    reply = os.read(ready_read, 16) if readable else b""
    if not reply:
      raise RuntimeError(
          f"A process did not enter its namespaces within {setup_timeout:g} s "
          f"(exit code {proc.poll()})."
      )
    if reply.startswith(b"E"):
      errno = int(reply[1:])
      raise PermissionError(f"{os.strerror(errno)} (errno {errno}). {privileges_hint}")
    wire(proc.pid)
    os.write(wired_write, b"G")
    return proc
  except BaseException:
    if proc is not None:
      stop([proc])
    raise
  finally:
    for fd in (ready_read, ready_write, wired_read, wired_write):
      if fd is not None:
        with contextlib.suppress(OSError):
          os.close(fd)


def kill_group(proc: subprocess.Popen) -> None:
  """SIGKILL to the process's whole group (it leads its own session)."""
  with contextlib.suppress(ProcessLookupError, PermissionError):
    os.killpg(proc.pid, signal.SIGKILL)


def stop(procs: Iterable[subprocess.Popen]) -> None:
  """Kills every process's group (also grandchildren of finished ones) and reaps them."""
  procs = list(procs)
  for proc in procs:
    kill_group(proc)
  for proc in procs:
    with contextlib.suppress(subprocess.TimeoutExpired):
      proc.wait(timeout=10)


EARLY_EXIT_GRACE = 5.0  # seconds a healthy run's ranks may finish apart


def wait(workers: Sequence[subprocess.Popen], timeout: float, say: Callable[[str], None]) -> int:
  """Polls the workers until all succeed, one fails or ``timeout`` passes.

  Returns:
    0 when every worker exited with 0; else the first failed worker's exit
    code (``128 + signal`` if a signal killed it), or `TIMEOUT_EXIT_CODE`.
    ``say`` tells which and what is stopped; the caller stops the rest.
  """
  deadline = time.monotonic() + timeout
  exited_at: dict[int, float] = {}  # rank -> when it exited with 0
  finished_early: list[int] = []  # exited with 0 and the others ran on past the grace
  while True:
    codes = [proc.poll() for proc in workers]
    running = [rank for rank, code in enumerate(codes) if code is None]
    failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
    if failed:
      rank, code = failed[0]
      reason = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
      early = (f" (after rank(s) {finished_early} had exited with 0 while the others ran: "
               "look there first)" if finished_early else "")
      say(f"rank {rank} {reason}{early}; stopping the {len(running)} process(es) still "
          f"running: ranks {running}.")
      return 128 - code if code < 0 else code
    now = time.monotonic()
    exited_at.update({rank: now for rank, code in enumerate(codes)
                      if code == 0 and rank not in exited_at})
    late = [rank for rank, at in exited_at.items()
            if rank not in finished_early and now - at > EARLY_EXIT_GRACE]
    if running and late:
      finished_early += late
      say(f"rank(s) {late} exited with 0 more than {EARLY_EXIT_GRACE:g} s ago while ranks "
          f"{running} still run: the others may wait for it in a collective until its "
          "heartbeat times out.")
    if not running:
      return 0
    if now > deadline:
      say(f"timeout after {timeout:g} s; killing ranks {running}.")
      return TIMEOUT_EXIT_CODE
    time.sleep(0.05)
