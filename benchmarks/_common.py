"""Helpers shared by the benchmark scripts: devices, meshes, steps, timing, output.

Every script forces its CPU device count before JAX starts (`force_devices`),
builds the real per-worker step of a registered method under
``jax.shard_map`` (`method_step`), and writes one JSON file that records the
machine and the versions (`write_json`).
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import platform
import subprocess
import sys
import time
from typing import Any

from exdyna_jax.methods import _registry

AXIS = "data"
RESNET18 = 11_173_962  # ResNet-18 parameters
LSTM = 28_900_000  # the seeds' LSTM, ~28.9M parameters
METHODS = tuple(_registry.SPARSIFIERS)  # every registered method, dense last
RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def force_devices(count: int) -> None:
  """Forces ``count`` CPU devices; must run before JAX's backend starts.

  Where the backend is up already (a test imported the script), JAX must
  already run on ``count`` CPU devices; otherwise JAX's error stands.
  """
  import jax

  try:
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", count)
  except RuntimeError:
    if jax.devices()[0].platform != "cpu" or jax.device_count() != count:
      raise


def mesh_of(num_workers: int):
  """A 1-D Auto mesh over the first ``num_workers`` devices."""
  import jax

  return jax.sharding.Mesh(
    jax.devices()[:num_workers], (AXIS,), axis_types=(jax.sharding.AxisType.Auto,)
  )


def make_tx(name: str, density: float, num_workers: int, **extra: Any):
  """The registered sparsifier ``name`` (``dense`` ignores ``density``).

  ``extra`` options go to the factory (e.g. ``controller="reference"``).

  ExDyna needs ``num_blocks >= 4 n`` (a partition keeps at least
  ``num_blocks / (4 n)`` blocks); the default 1024 is raised only beyond 256
  workers.
  """
  import exdyna_jax

  if name == "dense":
    return exdyna_jax.get_sparsifier(name, axis_name=AXIS)
  options: dict[str, Any] = {"density": density, "axis_name": AXIS}
  if name == "exdyna" and 4 * num_workers > 1024:
    options["num_blocks"] = 4 * num_workers
  return exdyna_jax.get_sparsifier(name, **options, **extra)


def method_step(
  name: str, density: float, num_workers: int, num_elements: int, donate=True, **extra: Any
):
  """The real per-worker update of method ``name`` under ``jax.shard_map``.

  The gradient is one flat float32 leaf of ``num_elements`` per worker (the
  global array is ``[n * N]`` sharded over the mesh); the optimizer state has
  a leading worker axis.

  Returns:
    ``(init, step, mesh)``: ``init(params) -> state`` and
    ``step(grads, state, params) -> (state, updates)``, both jitted
    ``shard_map`` programs; ``step`` donates the state when ``donate``.
  """
  import jax
  from jax import P

  mesh = mesh_of(num_workers)
  tx = make_tx(name, density, num_workers, **extra)

  def init(params):
    return jax.tree.map(lambda s: s[None], tx.init(params))

  def update(grads, state, params):
    state = jax.tree.map(lambda s: s[0], state)
    updates, state = tx.update(grads, state, params)
    # State first: jit pairs each donated buffer with the first output of the
    # same per-device shape, and the residual must land in its own buffer
    # (with the update first, the update took it and the residual was copied).
    return jax.tree.map(lambda s: s[None], state), updates

  init_fn = jax.jit(jax.shard_map(init, mesh=mesh, in_specs=P(), out_specs=P(AXIS)))
  step_fn = jax.jit(
    jax.shard_map(
      update,
      mesh=mesh,
      in_specs=(P(AXIS), P(AXIS), P()),
      out_specs=(P(AXIS), P(AXIS)),
      check_vma=False,
    ),
    donate_argnums=(1,) if donate else (),
  )
  del num_elements
  return init_fn, step_fn, mesh


def _git(*args: str) -> str:
  root = pathlib.Path(__file__).resolve().parent.parent
  try:
    out = subprocess.run(
      ["git", *args], cwd=root, capture_output=True, text=True, timeout=10, check=False
    )
    return out.stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return ""


def utc_now() -> str:
  """This moment in UTC, to the second (ISO 8601)."""
  return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def machine_info() -> dict[str, Any]:
  """The machine, the load and the versions this result was measured with."""
  import jax
  import jaxlib
  import numpy as np
  import optax

  import exdyna_jax

  cpu = platform.processor()
  try:
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
      if line.startswith("model name"):
        cpu = line.split(":", 1)[1].strip()
        break
  except OSError:
    pass
  memory_gb = None
  try:
    for line in pathlib.Path("/proc/meminfo").read_text().splitlines():
      if line.startswith("MemTotal"):
        memory_gb = round(int(line.split()[1]) / 2**20, 1)
  except OSError:
    pass
  dirty = _git("status", "--porcelain", "--", "exdyna_jax")
  return {
    "date_utc": utc_now(),
    "hostname": platform.node(),
    "cpu": cpu,
    "cores": os.cpu_count(),
    "memory_gb": memory_gb,
    "load_average": os.getloadavg(),
    "platform": platform.platform(),
    "python": sys.version.split()[0],
    "jax": jax.__version__,
    "jaxlib": jaxlib.__version__,
    "optax": optax.__version__,
    "numpy": np.__version__,
    "exdyna_jax": exdyna_jax.__version__,
    "git_commit": _git("rev-parse", "--short", "HEAD"),
    "library_modified_since_commit": bool(dirty),
    "devices": len(jax.devices()),
    "xla_flags": os.environ.get("XLA_FLAGS", ""),
  }


def write_json(path: str | os.PathLike, payload: dict[str, Any]) -> None:
  """Writes ``payload`` with the machine info under ``"machine"``."""
  payload = {"machine": machine_info(), **payload}
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(payload, indent=1, default=_default) + "\n")
  print(f"wrote {path}", file=sys.stderr)


def _default(x):
  try:
    return x.tolist()
  except AttributeError:
    return str(x)


def blocked_seconds(step: Any, carry: Any, repeats: int) -> tuple[Any, list[float]]:
  """Runs ``carry = step(carry)`` ``repeats`` times, waiting for each result.

  Each time is a blocked step: what a loop that reads every step's result
  gets, the host's dispatch and its wait for the device included.

  Returns:
    ``(carry, seconds)``: the last carry and the seconds of each step.
  """
  carry, _, seconds = timed_calls(step, carry, repeats)
  return carry, seconds


def timed_calls(step: Any, carry: Any, repeats: int) -> tuple[Any, list[float], list[float]]:
  """`blocked_seconds`, with the seconds until each call returned as well.

  Returns:
    ``(carry, returned, seconds)``: the last carry, the seconds until each
    call returned (the host's dispatch: its launches, and any wait inside
    the program for a value the host reads) and until its result was ready.
  """
  import jax

  returned, seconds = [], []
  for _ in range(repeats):
    start = time.perf_counter()
    carry = step(carry)
    returned.append(time.perf_counter() - start)
    carry = jax.block_until_ready(carry)
    seconds.append(time.perf_counter() - start)
  return carry, returned, seconds


class Clock:
  """Wall time since construction, for progress lines and budgets."""

  def __init__(self):
    self.start = time.perf_counter()

  def __call__(self) -> float:
    return time.perf_counter() - self.start


def log(*parts: Any) -> None:
  """Progress to stderr (JSON results go to files)."""
  print(*parts, file=sys.stderr, flush=True)
