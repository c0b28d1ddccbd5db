"""What every section shares: the `Report` it writes into, the targets, table and number formats."""

from __future__ import annotations

import json
import pathlib
from typing import Any

from benchmarks import _common
from benchmarks.report import plots

TARGET = {"elements": _common.RESNET18, "workers": 8, "density": 0.001}


def load(results: pathlib.Path, name: str) -> dict[str, Any] | None:
  path = results / f"{name}.json"
  return json.loads(path.read_text()) if path.exists() else None


def ms(seconds: float) -> str:
  return f"{seconds * 1e3:,.0f}" if seconds >= 0.01 else f"{seconds * 1e3:.2f}"


def mb(num_bytes: float) -> str:
  return f"{num_bytes / 2**20:,.2f}"


def verdict(ok: bool) -> str:
  return "**met**" if ok else "**missed**"


def table(header: list[str], rows: list[list[Any]]) -> str:
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
  return "\n".join(lines)


def short(n: int) -> str:
  return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.0f}k"


class Report:
  """Accumulates markdown sections and target verdicts."""

  def __init__(self, results: pathlib.Path):
    self.results = results
    self.parts: list[str] = []
    self.targets: list[list[str]] = []

  def add(self, text: str) -> None:
    self.parts.append(text.strip() + "\n")

  def begin(self, title: str, data: Any, source: str) -> bool:
    """Adds the section's title; says so and returns False where ``data`` is missing."""
    self.add(title)
    if not data:
      self.add(f"_No `{source}`._")
    return bool(data)

  def target(self, what: str, goal: str, value: str, ok: bool | None) -> None:
    self.targets.append([what, goal, value, "n/a" if ok is None else verdict(ok)])

  def save_plot(self, fig, name: str) -> str:
    plots.save(fig, self.results / name)
    return f"![{name}]({name})"
