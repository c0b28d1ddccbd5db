"""An emulated cluster on one machine: every worker behind its own shaped link.

`ShapedNetwork` puts each worker process in a network namespace of its own,
joined to a bridge by a veth pair whose two ends are shaped with a token
bucket (``tc qdisc ... tbf``), so the worker's traffic in each direction is
held to its link rate; a rate of None leaves that link unshaped. The bridge
lives in a namespace of its own too (the hub), so nothing of the emulated
network touches the machine's own: the addresses come from 198.18.0.0/15
(RFC 2544's benchmarking range) and exist only inside namespaces the run
made.

Every namespace is anonymous: it exists while a process of the run is in it
and disappears with the last one, together with its veth ends and queues,
and no file is written (each worker gets its address as its host name in a
UTS namespace of its own, since gloo binds the address its host name
resolves to). Every process of the run dies with the launcher
(``PR_SET_PDEATHSIG``), so no exit path -- success, a failed or killed
worker, a timeout, Ctrl-C, or the launcher killed -- can leave a namespace
behind.

It needs ``CAP_NET_ADMIN`` and ``CAP_SYS_ADMIN``: run as root, or inside an
unprivileged user namespace (``unshare --user --map-root-user``), with the
``ip``, ``tc`` and ``nsenter`` commands (iproute2, util-linux) installed.
Link rates only: latency and loss would need ``netem``.
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
import shutil
import subprocess
import sys
import types
from collections.abc import Sequence

from exdyna_jax.launch import _processes

NETWORK = ipaddress.IPv4Network("198.18.0.0/15")
COORDINATOR_PORT = 8476  # free by construction: the namespaces are the run's own
TOOLS = ("ip", "tc", "nsenter")

# tc's rate units (decimal, bits per second).
_UNITS = types.MappingProxyType(
    {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12})
UNSHAPED = "unshaped"
HUB_NAME = "exdyna-jax-hub"

PRIVILEGES_HINT = (
    "Shaped links put every worker in a network namespace of its own, which needs "
    "CAP_NET_ADMIN and CAP_SYS_ADMIN: run as root (sudo), or inside an unprivileged user "
    "namespace: unshare --user --map-root-user python -m exdyna_jax.launch ... "
    "Without --link-rate the workers share the machine's loopback, unshaped."
)


def parse_rate(text: str) -> int | None:
  """A link rate in tc's notation, in bits per second; None for ``"unshaped"``.

  Example:
    >>> from exdyna_jax.launch import _shaped_links
    >>> _shaped_links.parse_rate("1gbit"), _shaped_links.parse_rate("2.5mbit")
    (1000000000, 2500000)
    >>> _shaped_links.parse_rate("unshaped") is None
    True

  Args:
    text: a number and one of tc's units (``bit``, ``kbit``, ``mbit``,
      ``gbit``, ``tbit``: powers of 1000), or ``"unshaped"``.

  Returns:
    The rate in bits per second, or None.

  Raises:
    ValueError: for anything else, or a rate under 8 kbit/s.
  """
  text = text.strip().lower()
  if text == UNSHAPED:
    return None
  match = re.fullmatch(r"(\d+(?:\.\d*)?|\.\d+)\s*(bit|kbit|mbit|gbit|tbit)", text)
  if not match:
    raise ValueError(
        f"Link rate {text!r} is not a number with a unit of tc's (bit, kbit, mbit, gbit, "
        f"tbit: for example 1gbit or 100mbit), nor {UNSHAPED!r}."
    )
  rate = round(float(match.group(1)) * _UNITS[match.group(2)])
  if rate < 8000:
    raise ValueError(f"Link rate {text!r} is under 8kbit: a step would take minutes.")
  return rate


def format_rate(rate: int | None) -> str:
  """``rate`` bits per second in tc's notation, the largest unit that keeps it whole.

  Example:
    >>> from exdyna_jax.launch import _shaped_links
    >>> _shaped_links.format_rate(1_000_000_000), _shaped_links.format_rate(2_500_000)
    ('1gbit', '2500kbit')
  """
  if rate is None:
    return UNSHAPED
  unit, scale = next((u, s) for u, s in reversed(_UNITS.items()) if rate % s == 0)
  return f"{rate // scale}{unit}"


def link_rates(spec: str | Sequence[str | int | None], processes: int) -> list[int | None]:
  """Each worker's link rate from one rate, or a comma-separated rate per worker.

  Example:
    >>> from exdyna_jax.launch import _shaped_links
    >>> _shaped_links.link_rates("1gbit", 2)
    [1000000000, 1000000000]
    >>> _shaped_links.link_rates("1gbit,100mbit,unshaped", 3)  # a straggler, a fast one
    [1000000000, 100000000, None]

  Args:
    spec: a rate for every worker, or one per worker (a comma-separated
      string, or a sequence of rate strings, bits per second, or None).
    processes: the number of workers.

  Returns:
    ``processes`` rates in bits per second (None: unshaped).

  Raises:
    ValueError: for a bad rate, or a count of rates that is neither 1 nor ``processes``.
  """
  items = spec.split(",") if isinstance(spec, str) else list(spec)
  rates = [
      item if item is None or isinstance(item, int) else parse_rate(item) for item in items
  ]
  if len(rates) == 1:
    rates = rates * processes
  if len(rates) != processes:
    raise ValueError(
        f"{len(rates)} link rates for {processes} processes: give one rate for all, or one each."
    )
  return rates


def describe(rates: Sequence[int | None]) -> str:
  """Each worker's address and link rate, for a log line."""
  return ", ".join(f"{address_of(rank)} {format_rate(rate)}" for rank, rate in enumerate(rates))


def address_of(rank: int) -> str:
  """Worker ``rank``'s address on the emulated network (198.18.0.1 for rank 0)."""
  if not 0 <= rank < NETWORK.num_addresses - 2:
    raise ValueError(f"No address for rank {rank} in {NETWORK}.")
  return str(NETWORK.network_address + rank + 1)


def _burst_bytes(rate: int) -> int:
  """The token bucket's depth: 4 ms at the link rate, at least 64 KiB (one GSO packet)."""
  return max(64 * 1024, math.ceil(rate / 8 * 0.004))


def _shaping(device: str, rate: int | None) -> list[str]:
  if rate is None:
    return []
  return [f"qdisc add dev {device} root tbf rate {rate}bit burst {_burst_bytes(rate)} "
          "latency 200ms"]


def hub_command(launcher_pid: int) -> list[str]:
  """The hub's command: it only waits, holding the bridge's namespace (named in ``ps``)."""
  return [sys.executable, "-c", "import signal; signal.pause()", f"{HUB_NAME}-of-{launcher_pid}"]


def check_tools() -> None:
  """Raises `PermissionError` when a command the network needs is missing."""
  missing = [tool for tool in TOOLS if shutil.which(tool) is None]
  if missing:
    raise PermissionError(
        f"Shaped links need the commands {', '.join(TOOLS)} (packages iproute2 and "
        f"util-linux); not found: {', '.join(missing)}."
    )


class ShapedNetwork:
  """A bridge in a namespace of its own, and a shaped link to each process `spawn` starts.

  Use it as a context manager: leaving it kills every process it started
  (the hub and the workers, each with its whole process group), which
  removes every namespace, link and queue of the run.

  Example:
    Two processes, each seeing only its own link at 100 Mbit/s::

      with ShapedNetwork() as network:
        workers = [network.spawn(["python", "worker.py"], rank, 100_000_000, env=env)
                   for rank in range(2)]
        ...  # wait for them

  Args:
    setup_timeout: seconds a new process may take to enter its namespaces.
  """

  def __init__(self, *, setup_timeout: float = _processes.SETUP_TIMEOUT):
    self.setup_timeout = setup_timeout
    self.processes: list[subprocess.Popen] = []
    self.hub: subprocess.Popen | None = None

  def __enter__(self) -> ShapedNetwork:
    check_tools()
    try:
      quiet = dict.fromkeys(("stdin", "stdout", "stderr"), subprocess.DEVNULL)
      self.hub = self._enter(hub_command(os.getpid()), "hub", quiet, wire=self._wire_hub)
    except BaseException:
      self.close()
      raise
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()

  def spawn(self, command: Sequence[str], rank: int, rate: int | None, **popen_kwargs):
    """Starts ``command`` as worker ``rank`` behind a link of ``rate`` bits/s (None: unshaped).

    Args:
      command: the program and its arguments.
      rank: the worker's rank: its address is `address_of(rank)`, also its host name.
      rate: the link rate both ways, bits per second, or None.
      **popen_kwargs: passed to `subprocess.Popen` (``env``, ``stdout``, ...).

    Returns:
      The `subprocess.Popen` of the worker, wired and running ``command``.
    """
    address = address_of(rank)

    def wire(pid):
      veth = f"w{rank}"
      self._ip(self.hub.pid, [f"link add {veth} type veth peer name eth0 netns {pid}",
                              f"link set {veth} master br0 up"])
      self._tc(self.hub.pid, _shaping(veth, rate))
      self._ip(pid, ["link set lo up", f"addr add {address}/{NETWORK.prefixlen} dev eth0",
                     "link set eth0 up"])
      self._tc(pid, _shaping("eth0", rate))

    return self._enter(command, address, popen_kwargs, wire=wire)

  def close(self) -> None:
    """Kills every process the network started (each with its process group) and reaps them."""
    _processes.stop(self.processes)

  def _enter(self, command, hostname, popen_kwargs, *, wire) -> subprocess.Popen:
    proc = _processes.start_isolated(
        command, hostname, wire, privileges_hint=PRIVILEGES_HINT,
        setup_timeout=self.setup_timeout, **popen_kwargs,
    )
    self.processes.append(proc)
    return proc

  def _wire_hub(self, pid: int) -> None:
    self._ip(pid, ["link add br0 type bridge", "link set br0 up"])

  @staticmethod
  def _ip(pid: int, commands: Sequence[str], tool: str = "ip") -> None:
    if not commands:
      return
    result = subprocess.run(
        ["nsenter", f"--target={pid}", "--net", "--", tool, "-batch", "-"],
        input="\n".join(commands) + "\n", capture_output=True, text=True, check=False,
    )
    if result.returncode:
      raise RuntimeError(
          f"Setting up the emulated network failed: {tool} {commands!r} said "
          f"{result.stderr.strip()!r}."
      )

  @classmethod
  def _tc(cls, pid: int, commands: Sequence[str]) -> None:
    cls._ip(pid, commands, tool="tc")
