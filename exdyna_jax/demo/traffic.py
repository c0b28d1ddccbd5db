"""Bytes a compiled program exchanges, read from its HLO.

The sparsifiers report ``SparsifierStats.bytes_sent`` from a formula. This
module measures the same quantity from what XLA actually compiled: it finds
every collective in ``jax.jit(f).lower(...).compile().as_text()`` and prices
it with the per-worker cost of the bandwidth-optimal ring algorithm, the
model the formula uses too:

=====================  ====================================  ===================
collective             result shape (per device)             bytes one worker sends
=====================  ====================================  ===================
``all-gather``         ``R`` bytes (all ``g`` pieces)          ``(g - 1) R / g``
``all-reduce``         ``M`` bytes (tuple elements summed)    ``2 (g - 1) M / g``
``reduce-scatter``     ``R`` bytes (one piece)                ``(g - 1) R``
``all-to-all``         ``M`` bytes                            ``(g - 1) M / g``
``collective-permute`` ``M`` bytes                            ``M``
=====================  ====================================  ===================

``g`` is the size of the op's replica group.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import NamedTuple

DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}  # fmt: skip

COLLECTIVE_KINDS = (
    "all-gather",
    "all-reduce",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
)

_INSTRUCTION = re.compile(
    r"=\s*(?P<shape>\(.*?\)|\w+\[[\d,]*\](?:\{[^}]*\})?)\s+"
    r"(?P<kind>" + "|".join(COLLECTIVE_KINDS) + r")(?P<start>-start)?\("
)
_ARRAY_SHAPE = re.compile(r"(?P<dtype>[a-z]+\d*)\[(?P<dims>[\d,]*)\]")
_EXPLICIT_GROUPS = re.compile(r"replica_groups=\{\{(?P<first>[\d,]*)\}")
_IOTA_GROUPS = re.compile(r"replica_groups=\[(?P<dims>[\d,]+)\]<=")


class Collective(NamedTuple):
  """One collective instruction of a compiled program.

  Attributes:
    kind: ``"all-gather"``, ``"all-reduce"``, ``"reduce-scatter"``,
      ``"all-to-all"`` or ``"collective-permute"``.
    shapes: ``(dtype, dims)`` of each array of the result (several when XLA
      combined collectives into one tuple-shaped instruction).
    group_size: workers taking part, ``g``.
    result_bytes: bytes of the result on one device.
    bytes_sent: bytes one worker sends, by the ring cost model.
  """

  kind: str
  shapes: tuple[tuple[str, tuple[int, ...]], ...]
  group_size: int
  result_bytes: int
  bytes_sent: int


def _array_shapes(shape_text: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
  shapes = []
  for match in _ARRAY_SHAPE.finditer(shape_text):
    if match["dtype"] not in DTYPE_BYTES:
      continue
    dims = tuple(int(d) for d in match["dims"].split(",") if d)
    shapes.append((match["dtype"], dims))
  return tuple(shapes)


def _group_size(line: str, num_devices: int) -> int:
  explicit = _EXPLICIT_GROUPS.search(line)
  if explicit:
    return max(1, len([d for d in explicit["first"].split(",") if d]))
  iota = _IOTA_GROUPS.search(line)
  if iota:
    return int(iota["dims"].split(",")[-1])
  return num_devices


def _ring_bytes(kind: str, result_bytes: int, group_size: int) -> int:
  g = group_size
  if kind == "all-gather":
    return (g - 1) * result_bytes // g
  if kind == "all-reduce":
    return 2 * (g - 1) * result_bytes // g
  if kind == "reduce-scatter":
    return (g - 1) * result_bytes
  if kind == "all-to-all":
    return (g - 1) * result_bytes // g
  return result_bytes  # collective-permute


def collectives(hlo_text: str, num_devices: int) -> list[Collective]:
  """Every collective in an HLO module, priced per worker.

  Args:
    hlo_text: ``compiled.as_text()`` of a program compiled for ``num_devices``
      devices (SPMD: shapes are per device).
    num_devices: devices of the program, the group size of ops that list no
      replica groups.

  Returns:
    The `Collective` instructions in program order.
  """
  found = []
  for line in hlo_text.splitlines():
    match = _INSTRUCTION.search(line)
    if not match:
      continue
    kind = match["kind"]
    shapes = _array_shapes(match["shape"])
    if match["start"] and kind == "all-gather" and len(shapes) > 1:
      shapes = shapes[len(shapes) // 2 :]  # (operands, results): keep the results
    result_bytes = sum(DTYPE_BYTES[dtype] * math.prod(dims) for dtype, dims in shapes)
    group_size = _group_size(line, num_devices)
    found.append(
        Collective(kind, shapes, group_size, result_bytes,
                   _ring_bytes(kind, result_bytes, group_size))
    )
  return found


def bytes_per_worker(hlo_text: str, num_devices: int) -> int:
  """Total bytes one worker sends in one run of the compiled program."""
  return sum(c.bytes_sent for c in collectives(hlo_text, num_devices))


def describe(found: Sequence[Collective]) -> str:
  """One line per collective, e.g. ``all-gather s32[8,17] g=8: 476 B``."""
  lines = []
  for c in found:
    shapes = ", ".join(f"{dtype}[{','.join(map(str, dims))}]" for dtype, dims in c.shapes)
    lines.append(f"{c.kind} {shapes} g={c.group_size}: {c.bytes_sent} B")
  return "\n".join(lines)
