"""Local multi-process launcher for testing multi-host training on one machine.

Starts ``--processes`` copies of a command on 127.0.0.1, each told through
environment variables who it is, where the coordinator listens and how many
CPU devices it owns (JAX's own ``JAX_NUM_CPU_DEVICES``); the worker calls
`initialize_from_env` before anything else touches JAX. The launcher forwards
every line the workers print with a ``[rank r]`` prefix, and stops all of them
(the whole process group of each, with SIGKILL: JAX ignores SIGTERM in some
states) as soon as one exits with a non-zero code, or when ``--timeout``
expires. It never waits unboundedly. With ``--link-rate`` each process runs
in a network namespace of its own behind a shaped link (`_shaped_links`).

Example::

  python -m exdyna_jax.launch --processes 2 --devices-per-process 2 -- \\
      python examples/multihost_train.py

Worker side::

  from exdyna_jax import launch
  launch.initialize_from_env()  # first thing: before any JAX computation
  import jax
  mesh = jax.make_mesh((jax.device_count(),), ("data",))

The same environment variables work on real hosts (one process per host):
set them yourself, or call ``jax.distributed.initialize`` directly. See
``docs/multihost.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence

from exdyna_jax.launch import _processes, _shaped_links
from exdyna_jax.launch._join import (  # noqa: F401  (the worker's side, re-exported)
    COORDINATOR_ENV,
    DEFAULT_HEARTBEAT_TIMEOUT,
    DEFAULT_INIT_TIMEOUT,
    DEVICES_PER_PROCESS_ENV,
    HEARTBEAT_TIMEOUT_ENV,
    INIT_TIMEOUT_ENV,
    NUM_PROCESSES_ENV,
    PROCESS_ID_ENV,
    initialize_from_env,
)

DEFAULT_TIMEOUT = 600.0
# Exit code of the launcher on timeout (a failed worker's own code is passed on).
TIMEOUT_EXIT_CODE = _processes.TIMEOUT_EXIT_CODE

# XLA:CPU allocates a program's temporaries at every execution, and glibc
# maps each allocation above 32 MB afresh, so every page a step touches there
# faults, every step: a dense step of a 4.7M-parameter MLP on 4 CPU devices
# (40 MB of temporaries) took 39,000 faults and 113 ms on one core, against
# none and 48 ms when malloc never maps and keeps what it frees for the next
# step. Workers get this unless GLIBC_TUNABLES is set already.
CPU_MALLOC_TUNABLES = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=1073741824"


def free_port(host: str = "127.0.0.1") -> int:
  """A TCP port that is free right now (bind to port 0 and let the OS pick).

  Example:
    >>> from exdyna_jax import launch
    >>> port = launch.free_port()
    >>> 1024 <= port < 65536
    True

  Args:
    host: the interface to bind to.

  Returns:
    The port number; another process may take it once this returns.
  """
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
    sock.bind((host, 0))
    return sock.getsockname()[1]


def _forward(stream, rank: int, sink, lock: threading.Lock) -> None:
  prefix = f"[rank {rank}] "
  for raw in iter(stream.readline, b""):
    line = raw.decode("utf-8", errors="replace").rstrip("\n")
    with lock:
      sink.write(prefix + line + "\n")
      sink.flush()
  stream.close()


def launch(
    command: Sequence[str],
    *,
    processes: int,
    devices_per_process: int = 1,
    timeout: float = DEFAULT_TIMEOUT,
    init_timeout: int = DEFAULT_INIT_TIMEOUT,
    heartbeat_timeout: int = DEFAULT_HEARTBEAT_TIMEOUT,
    env: Mapping[str, str] | None = None,
    stdout=None,
    stderr=None,
    link_rates: str | Sequence[str | int | None] | None = None,
    pin_cpus: bool = False,
) -> int:
  """Runs ``command`` as ``processes`` cooperating JAX processes on this machine.

  Example:
    Two processes of two CPU devices each, from Python (the command line
    ``python -m exdyna_jax.launch`` does the same)::

      import sys
      from exdyna_jax import launch
      code = launch.launch([sys.executable, "train.py"], processes=2,
                           devices_per_process=2, timeout=300)
      assert code == 0, f"a worker failed or timed out (exit code {code})"

  Args:
    command: the program and its arguments, e.g. ``["python", "train.py"]``.
    processes: number of processes.
    devices_per_process: CPU devices each process creates.
    timeout: seconds after which every process is killed.
    init_timeout: seconds ``jax.distributed.initialize`` waits for all
      processes to join.
    heartbeat_timeout: seconds after which the coordination service declares
      a silent process dead.
    env: base environment (default ``os.environ``); the ``EXDYNA_*``
      variables, ``JAX_PLATFORMS=cpu`` and
      ``JAX_CPU_COLLECTIVES_IMPLEMENTATION=gloo`` are set on top, and
      ``GLIBC_TUNABLES`` (`CPU_MALLOC_TUNABLES`) where it has none.
    stdout: where workers' standard output goes, prefixed (default
      ``sys.stdout``).
    stderr: where workers' standard error and the launcher's own messages go,
      prefixed (default ``sys.stderr``).
    link_rates: None (default): every process on 127.0.0.1. Otherwise each
      process runs in its own network namespace behind a link shaped to
      this rate both ways (`_shaped_links.ShapedNetwork`): one rate in
      tc's notation for every process (``"1gbit"``, ``"100mbit"``,
      ``"unshaped"``), or one per process (a comma-separated string or a
      sequence; a slower one is a straggler). Needs root or an unprivileged
      user namespace.
    pin_cpus: keep each process to its share of this process's CPUs
      (`_processes.cpu_shares`: equal parts, or one CPU each in turn where
      there are more processes than CPUs), as on machines of their own.
      Unpinned, processes that outnumber the cores starve one another: a
      step of four processes on two cores now and then took ten times its
      median, and the others waited for it at their next collective.
      Linux only.

  Returns:
    0 if every process exited with 0; otherwise the exit code of the first
    process that failed (``128 + signal`` if it was killed by a signal), or
    `TIMEOUT_EXIT_CODE` on timeout.

  Raises:
    ValueError: for fewer than one process or device, an empty command, bad
      link rates, or ``pin_cpus`` where the platform cannot pin.
    PermissionError: for ``link_rates`` without the privileges or the
      commands a network namespace needs (the message says what to do).
  """
  if processes < 1 or devices_per_process < 1:
    raise ValueError("processes and devices_per_process must be at least 1.")
  if not command:
    raise ValueError("No command to launch.")
  if pin_cpus and not hasattr(os, "sched_setaffinity"):
    raise ValueError("pin_cpus needs os.sched_setaffinity (Linux).")
  stdout = sys.stdout if stdout is None else stdout
  stderr = sys.stderr if stderr is None else stderr
  lock = threading.Lock()

  def say(message: str) -> None:
    with lock:
      stderr.write(f"[launch] {message}\n")
      stderr.flush()

  rates = None if link_rates is None else _shaped_links.link_rates(link_rates, processes)
  coordinator = (
      f"127.0.0.1:{free_port()}" if rates is None
      else f"{_shaped_links.address_of(0)}:{_shaped_links.COORDINATOR_PORT}"
  )
  base = dict(os.environ if env is None else env)
  base.setdefault("GLIBC_TUNABLES", CPU_MALLOC_TUNABLES)
  base.update(
      {
          "JAX_PLATFORMS": "cpu",
          "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo",
          "PYTHONUNBUFFERED": "1",
          COORDINATOR_ENV: coordinator,
          NUM_PROCESSES_ENV: str(processes),
          DEVICES_PER_PROCESS_ENV: str(devices_per_process),
          INIT_TIMEOUT_ENV: str(init_timeout),
          HEARTBEAT_TIMEOUT_ENV: str(heartbeat_timeout),
      }
  )
  shares = _processes.cpu_shares(processes, sorted(os.sched_getaffinity(0))) if pin_cpus else None

  def env_of(rank: int) -> dict[str, str]:
    env = {**base, PROCESS_ID_ENV: str(rank)}
    if shares:
      env[_processes.CPUS_ENV] = ",".join(map(str, shares[rank]))
    return env

  pipes = dict(stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  workers: list[subprocess.Popen] = []
  threads: list[threading.Thread] = []
  with contextlib.ExitStack() as stack:
    start = lambda rank: _processes.start(command, env=env_of(rank), **pipes)  # noqa: E731
    if rates is not None:
      network = stack.enter_context(_shaped_links.ShapedNetwork())
      say(f"each process behind its own link: {_shaped_links.describe(rates)}")
      start = lambda rank: network.spawn(command, rank, rates[rank], env=env_of(rank), **pipes)  # noqa: E731
    try:
      for rank in range(processes):
        workers.append(proc := start(rank))
        for stream, sink in ((proc.stdout, stdout), (proc.stderr, stderr)):
          thread = threading.Thread(target=_forward, args=(stream, rank, sink, lock), daemon=True)
          thread.start()
          threads.append(thread)
      return _processes.wait(workers, timeout, say)
    finally:
      _processes.stop(workers)
      for thread in threads:
        thread.join(timeout=5)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  """Parses the command line of ``python -m exdyna_jax.launch``.

  Example:
    >>> from exdyna_jax import launch
    >>> args = launch.parse_args(
    ...     ["--processes", "2", "--devices-per-process", "2", "--", "python", "train.py"])
    >>> args.processes, args.devices_per_process, args.timeout, args.command
    (2, 2, 600.0, ['python', 'train.py'])

  Args:
    argv: the arguments after the program name (default ``sys.argv[1:]``).

  Returns:
    The options, with ``command`` the worker's command line (``--`` removed).
    Exits with a usage message (``SystemExit``) if no command is given.
  """
  parser = argparse.ArgumentParser(
      prog="python -m exdyna_jax.launch",
      description=(
          "Run a command as several cooperating JAX processes on 127.0.0.1 "
          "(CPU devices, gloo collectives). The command must call "
          "exdyna_jax.launch.initialize_from_env() before using JAX."
      ),
  )
  parser.add_argument("--processes", type=int, default=2, help="number of processes")
  parser.add_argument(
      "--devices-per-process", type=int, default=1, help="CPU devices in each process"
  )
  parser.add_argument(
      "--timeout", type=float, default=DEFAULT_TIMEOUT, help="kill everything after (s)"
  )
  parser.add_argument(
      "--init-timeout",
      type=int,
      default=DEFAULT_INIT_TIMEOUT,
      help="seconds to wait for all processes to join",
  )
  parser.add_argument(
      "--heartbeat-timeout",
      type=int,
      default=DEFAULT_HEARTBEAT_TIMEOUT,
      help="seconds after which a silent process is declared dead",
  )
  parser.add_argument(
      "--link-rate",
      default=None,
      help=(
          "run each process in its own network namespace behind a link shaped to this rate "
          "both ways, in tc's notation (1gbit, 100mbit, unshaped), or one rate per process, "
          "comma-separated (a straggler); needs root or an unprivileged user namespace"
      ),
  )
  parser.add_argument(
      "--pin-cpus",
      action="store_true",
      help="keep each process to its share of this machine's CPUs (Linux)",
  )
  parser.add_argument("command", nargs=argparse.REMAINDER, help="-- program args...")
  args = parser.parse_args(argv)
  args.command = args.command[1:] if args.command[:1] == ["--"] else args.command
  if not args.command:
    parser.error("no command given (put it after --)")
  for name in ("processes", "devices_per_process"):
    if getattr(args, name) < 1:
      parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
  if args.link_rate is not None:
    try:
      _shaped_links.link_rates(args.link_rate, args.processes)
    except ValueError as error:
      parser.error(str(error))
  return args


def main(argv: Sequence[str] | None = None) -> int:
  """Command line: ``python -m exdyna_jax.launch [options] -- command ...``.

  Example:
    The same as the command line, from Python::

      from exdyna_jax import launch
      code = launch.main(["--processes", "2", "--devices-per-process", "2",
                          "--", "python", "examples/multihost_train.py"])

  Args:
    argv: the arguments after the program name (default ``sys.argv[1:]``).

  Returns:
    The exit code of `launch`; 127 where the command is not found, 2 where
    shaped links cannot be made here (the message says why and what to do),
    130 on Ctrl-C (every process of the run stopped).
  """
  args = parse_args(argv)
  if shutil.which(args.command[0]) is None:
    print(f"[launch] command not found: {args.command[0]!r} (not on PATH, nor an executable "
          "file)", file=sys.stderr)
    return 127
  try:
    return launch(
        args.command,
        processes=args.processes,
        devices_per_process=args.devices_per_process,
        timeout=args.timeout,
        init_timeout=args.init_timeout,
        heartbeat_timeout=args.heartbeat_timeout,
        link_rates=args.link_rate,
        pin_cpus=args.pin_cpus,
    )
  except PermissionError as error:
    print(f"[launch] {error}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    print("[launch] interrupted; every process of the run was stopped.", file=sys.stderr)
    return 130

