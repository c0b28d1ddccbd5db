"""What a compiled XLA program's collectives send: bytes per worker, read from its HLO.

The sparsifiers report ``SparsifierStats.bytes_sent`` from a formula; this
module measures the same quantity from what XLA compiled. `collectives`
reads the text of a compiled module
(``jax.jit(f).lower(...).compile().as_text()``) and lists, per step, every
all-gather, all-reduce, reduce-scatter, all-to-all and collective-permute
with its shapes and its cost to one worker; `bytes_per_worker` sums them.
Collectives inside a ``conditional`` count once, for the most expensive
branch (only one branch runs per step); a collective inside a ``while`` body
is counted once and flagged; the count a skipped step takes (name scope
``skipped_step``) and ExDyna's gather of a step that selects again
(``selected_again``) are not a step's.

`ring_cost` prices one op with the ring algorithms (``g`` = workers in the
op's group, ``M`` = bytes of the op's result, ``R`` for reduce-scatter's
result per worker):

============================  =====================  ===================
op                            bytes sent per worker  messages per worker
============================  =====================  ===================
all-reduce of ``M``           ``2 (g-1)/g * M``      ``2 (g-1)``
all-gather, result ``M``      ``(g-1)/g * M``        ``g - 1``
reduce-scatter, result ``R``  ``(g-1) * R``          ``g - 1``
all-to-all of ``M``           ``(g-1)/g * M``        ``g - 1``
collective-permute of ``M``   ``M * pairs / n``      ``pairs / n``
============================  =====================  ===================

Every op is symmetric, so bytes received equal bytes sent. ``log_messages``
gives the message count of the latency-optimal alternatives instead
(recursive doubling / Bruck / Rabenseifner, same bytes for powers of two):
``2 ceil(log2 g)`` for all-reduce, ``ceil(log2 g)`` for the others, 1 for a
permute.

Example:
  An all-reduce of 1,000 float32 on 8 workers: each sends ``2 * 7/8 * 4000`` bytes.

  >>> import jax, jax.numpy as jnp
  >>> from exdyna_jax import hlo
  >>> mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,),
  ...                      devices=jax.devices()[:8])
  >>> mean = jax.jit(jax.shard_map(lambda x: jax.lax.pmean(x, "data"), mesh=mesh,
  ...                              in_specs=jax.P("data"), out_specs=jax.P()))
  >>> text = mean.lower(jnp.ones(8 * 1000)).compile().as_text()
  >>> [(op.kind, op.result_bytes, op.bytes_sent) for op in hlo.collectives(text, 8)]
  [('all-reduce', 4000, 7000.0)]
  >>> hlo.bytes_per_worker(text, 8)
  7000
"""

from __future__ import annotations

import math
import re
import types
from collections.abc import Sequence
from typing import Any, NamedTuple

# The name scopes of what the library runs only on a rare step: the guard's
# count of a skipped step's bad elements, and ExDyna's second gather of the
# index buffers where they did not hold all that passed (`exdyna(network=...)`).
# Not part of a normal step's traffic. Written out, not imported from
# `exdyna_jax.shell._guard` and `exdyna_jax.methods.exdyna._early_selection`: this reader depends on
# no part of the library (tests/test_hlo.py checks they agree).
SKIPPED_STEP_SCOPE = "skipped_step"
SELECTED_AGAIN_SCOPE = "selected_again"
KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
DTYPE_BYTES = types.MappingProxyType({
  "pred": 1,
  "s8": 1,
  "u8": 1,
  "s16": 2,
  "u16": 2,
  "f16": 2,
  "bf16": 2,
  "s32": 4,
  "u32": 4,
  "f32": 4,
  "s64": 8,
  "u64": 8,
  "f64": 8,
  "c64": 8,
  "c128": 16,
})

_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_CALLED = re.compile(
  r"(?:calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)"
)
BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


def split_type(rest: str) -> tuple[str, str]:
  """``"f32[8]{0} all-gather(...), ..."`` -> (``"f32[8]{0}"``, remainder)."""
  if rest.startswith("("):
    depth = 0
    for i, c in enumerate(rest):
      depth += c == "("
      depth -= c == ")"
      if depth == 0:
        return rest[: i + 1], rest[i + 1 :].strip()
  head, _, tail = rest.partition(" ")
  return head, tail.strip()


def shape_bytes(type_text: str) -> tuple[int, list[str]]:
  """Total bytes and the array shapes of an HLO (possibly tuple) type."""
  total, shapes = 0, []
  for dtype, dims in _ARRAY.findall(type_text):
    if dtype not in DTYPE_BYTES:
      continue
    count = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
    total += count * DTYPE_BYTES[dtype]
    shapes.append(f"{dtype}[{dims}]")
  return total, shapes


def _group_size(attributes: str, default: int) -> int:
  match = re.search(r"replica_groups=\{\{([^}]*)\}", attributes)
  if match:
    return len(match.group(1).split(","))
  match = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", attributes)
  if match:
    return int(match.group(2))
  return default


def _pairs(attributes: str) -> int:
  match = re.search(r"source_target_pairs=\{(.*?)\}\}", attributes)
  return len(re.findall(r"\{\d+,\d+", match.group(0))) if match else 0


def parse_module(text: str) -> tuple[dict[str, list[str]], str]:
  """Computations of an HLO module: ``{name: instruction lines}``, entry name."""
  computations: dict[str, list[str]] = {}
  entry, current = "", None
  for line in text.splitlines():
    header = _COMPUTATION.match(line)
    if header and "=" not in line.split("(")[0]:
      current = header.group(2)
      computations[current] = []
      if header.group(1):
        entry = current
      continue
    if line.strip() == "}":
      current = None
      continue
    if current is not None and INSTRUCTION.match(line):
      computations[current].append(line)
  return computations, entry



class RingCost(NamedTuple):
  """What one collective costs one worker on a ring (see the module's table).

  Attributes:
    bytes: bytes one worker sends (and receives).
    messages: messages one worker sends with the ring algorithm.
    log_messages: messages with the latency-optimal alternative.
  """

  bytes: float
  messages: float
  log_messages: float


class Collective(NamedTuple):
  """One collective a compiled step runs, priced for one worker.

  Attributes:
    kind: one of `KINDS`.
    shapes: ``(dtype, dims)`` of each array of the result (several when XLA
      combined collectives into one tuple-shaped instruction).
    group_size: workers taking part, ``g``.
    result_bytes: bytes of the result on one device.
    pairs: source-target pairs of a collective-permute (0 for the others).
    context: ``"conditional"`` or ``"loop"`` when the op sits inside one,
      else ``""``.
    bytes_sent: bytes one worker sends, by the ring cost model.
    messages: messages one worker sends, ring algorithm.
    log_messages: messages with the latency-optimal algorithm.
  """

  kind: str
  shapes: tuple[tuple[str, tuple[int, ...]], ...]
  group_size: int
  result_bytes: int
  pairs: int
  context: str
  bytes_sent: float
  messages: float
  log_messages: float


def ring_cost(kind: str, result_bytes: int, group_size: int, *, pairs: int = 0,
              num_devices: int | None = None) -> RingCost:
  """Per-worker bytes and messages of one collective on a ring.

  Args:
    kind: one of `KINDS`.
    result_bytes: bytes of the op's result on one device.
    group_size: workers taking part.
    pairs: source-target pairs of a collective-permute.
    num_devices: devices of the program, which a permute's pairs share
      (default: ``group_size``).

  Returns:
    The `RingCost` of the module's table.
  """
  g, size = group_size, result_bytes
  if g <= 1:
    return RingCost(0.0, 0.0, 0.0)
  rounds = math.ceil(math.log2(g))
  if kind == "all-reduce":
    return RingCost(2 * (g - 1) / g * size, 2 * (g - 1), 2 * rounds)
  if kind in ("all-gather", "all-to-all"):
    return RingCost((g - 1) / g * size, g - 1, rounds)
  if kind == "reduce-scatter":
    return RingCost((g - 1) * size, g - 1, rounds)
  share = pairs / (num_devices or g) if pairs else 1.0
  return RingCost(size * share, share, share)


def _parse_shape(text: str) -> tuple[str, tuple[int, ...]]:
  dtype, dims = text.rstrip("]").split("[")
  return dtype, tuple(int(d) for d in dims.split(",") if d)


def _op(line: str, num_devices: int, context: str) -> Collective | None:
  rest = INSTRUCTION.match(line).group(2)
  type_text, remainder = split_type(rest.strip())
  opcode = remainder.split("(", 1)[0].strip()
  if opcode.endswith("-start"):
    return None  # counted at the matching -done, whose type is the result
  kind = opcode.removesuffix("-done")
  if kind not in KINDS:
    return None
  result_bytes, shapes = shape_bytes(type_text)
  group = _group_size(remainder, num_devices)
  pairs = _pairs(remainder) if kind == "collective-permute" else 0
  cost = ring_cost(kind, result_bytes, group, pairs=pairs, num_devices=num_devices)
  return Collective(kind, tuple(map(_parse_shape, shapes)), group, result_bytes, pairs,
                    context, cost.bytes, cost.messages, cost.log_messages)


def collectives(hlo_text: str, num_devices: int) -> list[Collective]:
  """The collectives one step of the compiled program runs, in program order.

  Args:
    hlo_text: ``compiled.as_text()`` of a program compiled for
      ``num_devices`` devices (SPMD: shapes are per device).
    num_devices: devices of the program, the group size of ops that list no
      replica groups.

  Returns:
    One `Collective` per op.
  """
  computations, entry = parse_module(hlo_text)
  rare = (SKIPPED_STEP_SCOPE, SELECTED_AGAIN_SCOPE)

  def walk(name: str, context: str, seen: frozenset) -> list[Collective]:
    ops: list[Collective] = []
    for line in computations.get(name, []):
      op = _op(line, num_devices, context)
      if op is not None:
        ops.extend([op] if not any(f"/{scope}/" in line for scope in rare) else [])
        continue
      branches = BRANCHES.search(line)
      called = [c for c in _CALLED.findall(line) if c in computations and c not in seen]
      if branches or " conditional(" in line:
        names = called
        if branches:
          names = [b.strip().lstrip("%") for b in branches.group(1).split(",")]
        options = [walk(b, "conditional", seen | {b}) for b in names if b in computations]
        if options:
          ops.extend(max(options, key=lambda o: sum(x.bytes_sent for x in o)))
        continue
      for c in called:
        ops.extend(walk(c, "loop" if " while(" in line else context, seen | {c}))
    return ops

  return walk(entry, "", frozenset({entry}))


def bytes_per_worker(hlo_text: str, num_devices: int) -> int:
  """Bytes one worker sends in one step of the compiled program (see `collectives`)."""
  return round(sum(op.bytes_sent for op in collectives(hlo_text, num_devices)))


def totals(ops: Sequence[Collective]) -> dict[str, Any]:
  """``bytes``, ``messages`` and ``log_messages`` summed over ``ops``, overall and per kind."""
  out: dict[str, Any] = {"bytes": 0.0, "messages": 0.0, "log_messages": 0.0, "by_kind": {}}
  for op in ops:
    kind = out["by_kind"].setdefault(op.kind, {"ops": 0, "bytes": 0.0, "messages": 0.0})
    kind["ops"] += 1
    kind["bytes"] += op.bytes_sent
    kind["messages"] += op.messages
    out["bytes"] += op.bytes_sent
    out["messages"] += op.messages
    out["log_messages"] += op.log_messages
  return out

