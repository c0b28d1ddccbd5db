"""Memory traffic of a compiled XLA program: what the benchmarks' static profile reads.

`memory_traffic` estimates the bytes one step reads and writes from the
top-level ops of ``jax.jit(f).lower(...).compile().as_text()``; a fusion that
reads an operand only through slices or gathers reads what those return, not
the whole operand. It builds on the module parser of `exdyna_jax.hlo`.
"""

from __future__ import annotations

import re
from typing import Any

from exdyna_jax.hlo import (
  BRANCHES,
  INSTRUCTION,
  KINDS,
  parse_module,
  shape_bytes,
  split_type,
)

_SKIP = {
  "parameter",
  "constant",
  "bitcast",
  "get-tuple-element",
  "tuple",
  "after-all",
  "partition-id",
  "replica-id",
  "iota",
}


def _opcode_and_operands(line: str) -> tuple[str, str, list[str], str]:
  """(name, type, operand names, opcode) of one instruction line."""
  name, rest = INSTRUCTION.match(line).groups()
  type_text, remainder = split_type(rest.strip())
  opcode, _, args = remainder.partition("(")
  depth, end = 1, 0
  for i, c in enumerate(args):
    depth += c == "("
    depth -= c == ")"
    if depth == 0:
      end = i
      break
  operands = re.findall(r"%([\w.\-]+)", args[:end])
  return name, type_text, operands, opcode.strip()


def _sliced_parameters(lines: list[str]) -> dict[int, int]:
  """``{parameter index: bytes read}`` for a fused computation's sliced parameters.

  A parameter that the fusion reads only through ``dynamic-slice``,
  ``slice`` or ``gather`` (directly or through bitcasts) is read for the
  bytes those return, not for its own size.
  """
  parameters: dict[str, int] = {}
  aliases: dict[str, str] = {}  # bitcast of a parameter -> the parameter
  reads: dict[str, list[int | None]] = {}  # parameter -> bytes per use (None: whole)
  for line in lines:
    name, type_text, operands, opcode = _opcode_and_operands(line)
    if opcode == "parameter":
      parameters[name] = int(re.search(r"parameter\((\d+)\)", line).group(1))
      continue
    for position, operand in enumerate(operands):
      source = aliases.get(operand, operand)
      if source not in parameters:
        continue
      if opcode == "bitcast":
        aliases[name] = source
      elif opcode in ("dynamic-slice", "slice", "gather") and position == 0:
        reads.setdefault(source, []).append(shape_bytes(type_text)[0])
      else:
        reads.setdefault(source, []).append(None)
  return {parameters[name]: sum(uses) for name, uses in reads.items() if None not in uses}


def memory_traffic(text: str, min_bytes: int) -> dict[str, Any]:
  """Bytes the top-level ops of the entry computation read and write.

  After fusion each top-level op (a fusion, a sort, a scatter, a copy, a
  collective) reads its operands from memory and writes its result, so the
  sum over them of ``operand bytes + result bytes`` estimates the memory
  traffic of one step. Scatters are taken as in place (only their small
  operands count) and gathers and dynamic slices as reading only what they
  return, and a fusion that reads an operand only through slices as
  reading the slices. A ``conditional`` counts as the branch a normal step
  takes (only one runs): among its branches that hold collectives (a
  skip-the-step branch holds none), the cheapest (a whole-vector fallback is
  the costlier); a ``while`` counts one trip of its body (its trip count may
  be known only at run time: a loop over chunks of a range reads the range,
  in trips that may each fall below ``min_bytes``). Ops are listed with their
  computation.

  Args:
    text: ``compiled.as_text()`` of a per-device program.
    min_bytes: only arrays of at least this size are counted (e.g. ``N/2``
      float32: the passes over the whole vector).

  Returns:
    ``{"bytes": total, "ops": [(bytes, opcode, op_name), ...] largest first}``.
  """
  computations, entry = parse_module(text)
  types: dict[str, str] = {}
  for lines in computations.values():
    for line in lines:
      name, type_text, _, _ = _opcode_and_operands(line)
      types[name] = type_text

  def communicates(comp: str, seen: frozenset = frozenset()) -> bool:
    for line in computations.get(comp, []):
      opcode = _opcode_and_operands(line)[3].removesuffix("-start").removesuffix("-done")
      if opcode in KINDS:
        return True
      called = re.findall(r"(?:calls|body|true_computation|false_computation)=%?([\w.\-]+)", line)
      branches = BRANCHES.search(line)
      if branches:
        called += [b.strip().lstrip("%") for b in branches.group(1).split(",")]
      if any(c not in seen and communicates(c, seen | {comp}) for c in called):
        return True
    return False

  def own_ops(comp: str) -> list[tuple[int, str, str, str]]:
    """Counted ops of ``comp``, each conditional replaced by its costliest branch."""
    ops = []
    for line in computations.get(comp, []):
      name, type_text, operands, opcode = _opcode_and_operands(line)
      if opcode in _SKIP:
        continue
      if opcode == "conditional":
        branches = BRANCHES.search(line)
        names = [b.strip().lstrip("%") for b in branches.group(1).split(",")] if branches else []
        names += re.findall(r"(?:true|false)_computation=%?([\w.\-]+)", line)
        names = [b for b in names if b in computations]
        # The branch a normal step takes: among the branches that communicate
        # (a skip-this-step branch does not), the cheapest (a fallback path
        # over the whole vector is the costlier one).
        talking = [b for b in names if communicates(b)] or names
        options = [own_ops(b) for b in talking]
        if options:
          ops.extend(min(options, key=lambda o: sum(x[0] for x in o)))
        continue
      if opcode == "while":
        body = re.search(r"body=%?([\w.\-]+)", line)
        ops.extend(own_ops(body.group(1)) if body else [])
        continue
      where = re.search(r'op_name="([^"]*)"', line)
      label = (where.group(1) if where else name).rsplit("/", 1)[-1]
      result = shape_bytes(type_text)[0]
      inputs = [shape_bytes(types.get(o, ""))[0] for o in operands]
      fused = re.search(r"calls=%?([\w.\-]+)", line) if opcode == "fusion" else None
      if fused:
        for index, read in _sliced_parameters(computations.get(fused.group(1), [])).items():
          if index < len(inputs):
            inputs[index] = read
      if opcode == "scatter" or label.startswith("scatter"):
        # In place: touches only the scattered entries (a copy, if any, is its own op).
        inputs, result = [b for b in inputs if b != result], 0
      elif opcode in ("gather", "dynamic-slice") or label.startswith(("gather", "dynamic_slice")):
        inputs = []  # reads only what it returns
      counted = sum(b for b in [result, *inputs] if b >= min_bytes)
      if counted:
        ops.append((counted, opcode, where.group(1) if where else name, comp))
    return ops

  ops = sorted(own_ops(entry), reverse=True)
  return {"bytes": sum(o[0] for o in ops), "ops": ops}
