"""Bytes a compiled program exchanges, read from its HLO.

The sparsifiers report ``SparsifierStats.bytes_sent`` from a formula. This
module measures the same quantity from what XLA actually compiled: every
collective in ``jax.jit(f).lower(...).compile().as_text()``, priced with the
per-worker cost of the ring algorithms (see `exdyna_jax.demo.hlo.ring_cost`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from exdyna_jax.demo import hlo


class Collective(NamedTuple):
  """One collective a compiled step runs.

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


def _parse_shape(text: str) -> tuple[str, tuple[int, ...]]:
  dtype, dims = text.rstrip("]").split("[")
  return dtype, tuple(int(d) for d in dims.split(",") if d)


def collectives(hlo_text: str, num_devices: int) -> list[Collective]:
  """The collectives one run of a compiled program executes, priced per worker.

  Collectives inside a ``conditional`` count once, for its most expensive
  branch (one branch runs per step).

  Args:
    hlo_text: ``compiled.as_text()`` of a program compiled for ``num_devices``
      devices (SPMD: shapes are per device).
    num_devices: devices of the program, the group size of ops that list no
      replica groups.

  Returns:
    The `Collective` instructions in program order.
  """
  return [
      Collective(
          kind=op["kind"],
          shapes=tuple(_parse_shape(shape) for shape in op["shapes"]),
          group_size=op["group"],
          result_bytes=op["result_bytes"],
          bytes_sent=round(hlo.ring_cost(op, num_devices)["bytes"]),
      )
      for op in hlo.collectives(hlo_text, num_devices)
  ]


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
