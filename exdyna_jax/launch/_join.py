"""Joining a multi-process run from the environment: the worker's side of the launcher.

`initialize_from_env` reads the ``EXDYNA_*`` variables the launcher (or you,
on real hosts) set, or recognises Slurm's and Open MPI's own, and calls
``jax.distributed.initialize``. `exdyna_jax.launch` re-exports it.
"""

from __future__ import annotations

import os
import types
from collections.abc import Mapping

COORDINATOR_ENV = "EXDYNA_COORDINATOR"
NUM_PROCESSES_ENV = "EXDYNA_NUM_PROCESSES"
PROCESS_ID_ENV = "EXDYNA_PROCESS_ID"
DEVICES_PER_PROCESS_ENV = "JAX_NUM_CPU_DEVICES"  # JAX's own switch (CPU devices per process)
INIT_TIMEOUT_ENV = "EXDYNA_INIT_TIMEOUT"
HEARTBEAT_TIMEOUT_ENV = "EXDYNA_HEARTBEAT_TIMEOUT"

DEFAULT_INIT_TIMEOUT = 60
DEFAULT_HEARTBEAT_TIMEOUT = 20


def _env_int(environ: Mapping[str, str], name: str) -> int | None:
  value = environ.get(name)
  if value is None or value == "":
    return None
  try:
    return int(value)
  except ValueError:
    raise ValueError(f"{name}={value!r} is not an integer.") from None


def initialize_from_env(environ: Mapping[str, str] | None = None) -> bool:
  """Joins the multi-process run described by the ``EXDYNA_*`` variables.

  Reads ``EXDYNA_COORDINATOR`` (``host:port`` of process 0),
  ``EXDYNA_NUM_PROCESSES``, ``EXDYNA_PROCESS_ID``, and optionally
  ``EXDYNA_INIT_TIMEOUT`` (seconds to wait for every process to join) and
  ``EXDYNA_HEARTBEAT_TIMEOUT`` (seconds after which a silent process is
  declared dead and the others are stopped). Call it before any JAX
  computation. The CPU devices of each process are JAX's own
  ``JAX_NUM_CPU_DEVICES`` (the launcher sets it).

  Without ``EXDYNA_NUM_PROCESSES``, a cluster's own launcher is recognised
  by its variables: Slurm (``srun``: ``SLURM_NTASKS``, ``SLURM_PROCID``)
  and Open MPI (``mpirun``: ``OMPI_COMM_WORLD_SIZE``). With more than one
  task it calls ``jax.distributed.initialize()``, which reads the rest from
  them, and checks that the run has as many processes as the launcher
  started (else each task would train alone, unnoticed). With none of
  these (or one process) it returns ``False``: the script then runs as a
  single process, unchanged.

  Example:
    First thing in the worker script, before any JAX computation::

      from exdyna_jax import launch
      launch.initialize_from_env()
      import jax  # jax.devices() now lists the devices of every process

    Without the variables, the script runs as one process:

    >>> from exdyna_jax import launch
    >>> launch.initialize_from_env({})
    False

  Args:
    environ: the environment to read (default ``os.environ``).

  Returns:
    Whether ``jax.distributed.initialize`` was called.

  Raises:
    ValueError: if the variables are inconsistent or not integers.
    RuntimeError: if a cluster launcher started several tasks and the run
      has another number of processes.
  """
  import jax

  environ = os.environ if environ is None else environ
  num_processes = _env_int(environ, NUM_PROCESSES_ENV)
  if num_processes is None:
    return _initialize_from_cluster(environ)
  if num_processes == 1:
    return False
  process_id = _env_int(environ, PROCESS_ID_ENV)
  coordinator = environ.get(COORDINATOR_ENV)
  if process_id is None or not coordinator:
    raise ValueError(
        f"{NUM_PROCESSES_ENV}={num_processes} needs {PROCESS_ID_ENV} and "
        f"{COORDINATOR_ENV} (host:port of process 0) as well."
    )
  if not 0 <= process_id < num_processes:
    raise ValueError(f"{PROCESS_ID_ENV}={process_id} is outside [0, {num_processes}).")
  init_timeout = _env_int(environ, INIT_TIMEOUT_ENV) or DEFAULT_INIT_TIMEOUT
  heartbeat = _env_int(environ, HEARTBEAT_TIMEOUT_ENV) or DEFAULT_HEARTBEAT_TIMEOUT
  jax.distributed.initialize(
      coordinator_address=coordinator,
      num_processes=num_processes,
      process_id=process_id,
      initialization_timeout=init_timeout,
      heartbeat_timeout_seconds=heartbeat,
      # A process that ends early must not keep the others waiting at exit.
      shutdown_timeout_seconds=heartbeat,
  )
  return True


# A cluster launcher's variable for the number of tasks, and the name to give it.
CLUSTER_TASKS_ENV = types.MappingProxyType(
    {"SLURM_NTASKS": "Slurm", "OMPI_COMM_WORLD_SIZE": "Open MPI"})


def _initialize_from_cluster(environ: Mapping[str, str]) -> bool:
  """``jax.distributed.initialize()`` where Slurm or Open MPI started several tasks."""
  import jax

  found = [(name, _env_int(environ, variable)) for variable, name in CLUSTER_TASKS_ENV.items()
           if environ.get(variable)]
  if not found or found[0][1] <= 1:
    return False
  launcher, tasks = found[0]
  jax.distributed.initialize()  # JAX reads the coordinator and the ranks from the launcher
  if jax.process_count() != tasks:
    raise RuntimeError(
        f"{launcher} started {tasks} tasks, but jax.distributed found {jax.process_count()} "
        "process(es): each would train alone. Set EXDYNA_COORDINATOR, EXDYNA_NUM_PROCESSES "
        "and EXDYNA_PROCESS_ID yourself (docs/multihost.md)."
    )
  return True
