"""Collectives of a compiled XLA program, and what they cost one worker on a ring.

`collectives` reads the text of a compiled HLO module
(``jax.jit(f).lower(...).compile().as_text()``) and lists, per step, every
all-gather, all-reduce, reduce-scatter, all-to-all and collective-permute
with its shapes. Collectives inside a ``conditional`` count once, for the
most expensive branch (only one branch runs per step); a collective inside a
``while`` body is counted once and flagged; the count a skipped step takes
(`exdyna_jax._guard`, name scope ``skipped_step``) and ExDyna's gather of a
step that selects again (`exdyna_jax._early_selection`, ``selected_again``)
are not a step's.

`ring_cost` converts one op into per-worker traffic and message counts with
the ring algorithms (``g`` = workers in the op's group, ``M`` = bytes of the
op's result, ``R`` for reduce-scatter's result per worker):

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
"""

from __future__ import annotations

import math
import re
import types
from typing import Any

# The name scopes of what the library runs only on a rare step: the guard's
# count of a skipped step's bad elements, and ExDyna's second gather of the
# index buffers where they did not hold all that passed (`exdyna(network=...)`).
# Not part of a normal step's traffic. Written out, not imported from
# `exdyna_jax._guard` and `exdyna_jax._early_selection`: the demo uses the
# public API only (tests/test_demo.py checks they agree).
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


def _op(line: str, num_devices: int) -> dict[str, Any] | None:
  name, rest = INSTRUCTION.match(line).groups()
  type_text, remainder = split_type(rest.strip())
  opcode = remainder.split("(", 1)[0].strip()
  if opcode.endswith("-start"):
    return None  # counted at the matching -done, whose type is the result
  kind = opcode.removesuffix("-done")
  if kind not in KINDS:
    return None
  result_bytes, shapes = shape_bytes(type_text)
  return {
    "name": name,
    "kind": kind,
    "shapes": shapes,
    "result_bytes": result_bytes,
    "group": _group_size(remainder, num_devices),
    "pairs": _pairs(remainder) if kind == "collective-permute" else 0,
  }


def collectives(text: str, num_devices: int) -> list[dict[str, Any]]:
  """The collectives one step of the compiled program runs, in program order.

  Args:
    text: ``compiled.as_text()``.
    num_devices: devices the program runs on (the default group size).

  Returns:
    One dict per op: ``kind``, ``shapes``, ``result_bytes``, ``group``,
    ``pairs`` (permutes), and ``context`` (``"conditional"`` or ``"loop"``
    when the op sits inside one).
  """
  computations, entry = parse_module(text)

  def walk(name: str, context: str, seen: frozenset) -> list[dict[str, Any]]:
    ops: list[dict[str, Any]] = []
    for line in computations.get(name, []):
      op = _op(line, num_devices)
      if op is not None:
        if not any(f"/{scope}/" in line for scope in (SKIPPED_STEP_SCOPE, SELECTED_AGAIN_SCOPE)):
          ops.append({**op, "context": context})
        continue
      branches = BRANCHES.search(line)
      called = [c for c in _CALLED.findall(line) if c in computations and c not in seen]
      if branches or " conditional(" in line:
        names = called
        if branches:
          names = [b.strip().lstrip("%") for b in branches.group(1).split(",")]
        options = [walk(b, "conditional", seen | {b}) for b in names if b in computations]
        if options:
          ops.extend(max(options, key=lambda o: sum(ring_cost(x)["bytes"] for x in o)))
        continue
      loop = " while(" in line
      for c in called:
        ops.extend(walk(c, "loop" if loop else context, seen | {c}))
    return ops

  return walk(entry, "", frozenset({entry}))


def ring_cost(op: dict[str, Any], num_devices: int | None = None) -> dict[str, float]:
  """Per-worker ``bytes`` sent (= received) and ``messages`` of one op on a ring."""
  g = op["group"]
  size = op["result_bytes"]
  kind = op["kind"]
  rounds = math.ceil(math.log2(g)) if g > 1 else 0
  if g <= 1:
    return {"bytes": 0.0, "messages": 0.0, "log_messages": 0.0}
  if kind == "all-reduce":
    return {"bytes": 2 * (g - 1) / g * size, "messages": 2 * (g - 1), "log_messages": 2 * rounds}
  if kind in ("all-gather", "all-to-all"):
    return {"bytes": (g - 1) / g * size, "messages": g - 1, "log_messages": rounds}
  if kind == "reduce-scatter":
    return {"bytes": (g - 1) * size, "messages": g - 1, "log_messages": rounds}
  n = num_devices or g
  share = op["pairs"] / n if op["pairs"] else 1.0
  return {"bytes": size * share, "messages": share, "log_messages": share}


def totals(ops: list[dict[str, Any]], num_devices: int) -> dict[str, Any]:
  """Sum of `ring_cost` over ``ops``, overall and per kind."""
  out: dict[str, Any] = {"bytes": 0.0, "messages": 0.0, "log_messages": 0.0, "by_kind": {}}
  for op in ops:
    cost = ring_cost(op, num_devices)
    kind = out["by_kind"].setdefault(op["kind"], {"ops": 0, "bytes": 0.0, "messages": 0.0})
    kind["ops"] += 1
    kind["bytes"] += cost["bytes"]
    kind["messages"] += cost["messages"]
    for key in ("bytes", "messages", "log_messages"):
      out[key] += cost[key]
  return out

