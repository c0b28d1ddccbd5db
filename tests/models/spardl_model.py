"""Independent NumPy model of SparDL (docs/algorithms.md, SparDL), both schedules.

Written literally from the text, worker by worker and message by message, in
float32: no shared code with the JAX transform. Used to check the transform
step by step.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np


def log_schedule(n: int) -> list[tuple[int, int]]:
  """``(gap, size)`` of every round of the released code's schedule."""
  if n == 1:
    return []
  num_rounds = math.ceil(math.log2(n))
  sizes = [2**i for i in range(num_rounds - 1)]
  if n - 2 ** (num_rounds - 1) > 0:
    sizes.append(n - 2 ** (num_rounds - 1))
  sizes.reverse()
  rounds = []
  gap = n - sizes[0]
  for size in sizes:
    rounds.append((gap, size))
    gap = gap // 2
  return rounds


def messages(schedule: str, n: int) -> list[list[tuple[int, int, list[int]]]]:
  """Per round, the messages ``(source, destination, blocks)``."""
  rounds = []
  if schedule == "log":
    for gap, size in log_schedule(n):
      rounds.append(
          [(r, (r + gap) % n, [(r + gap + j) % n for j in range(size)]) for r in range(n)]
      )
  elif schedule == "ring":
    for s in range(n - 1):
      rounds.append([(r, (r + 1) % n, [(r - s - 1) % n]) for r in range(n)])
  else:
    raise ValueError(schedule)
  return rounds


def expected_receives(schedule: str, n: int, rank: int, round_index: int) -> list[int]:
  """The blocks the text says ``rank`` receives in a round (for self-checks)."""
  if schedule == "log":
    _, size = log_schedule(n)[round_index]
    return [(rank + j) % n for j in range(size)]
  return [(rank - round_index - 2) % n]


def on_the_wire(values: np.ndarray, dtype) -> np.ndarray:
  """``values`` as a message in ``dtype`` carries them (clipped to its range), as float32."""
  limit = float(ml_dtypes.finfo(dtype).max)
  return np.clip(values, -limit, limit).astype(dtype).astype(np.float32)


def top_k(x: np.ndarray, k: int) -> np.ndarray:
  """Positions of the ``k`` largest ``|x|``, ties towards the lower index."""
  order = sorted(range(x.shape[0]), key=lambda i: (-abs(float(x[i])), i))
  return np.array(order[:k], dtype=np.int64)


class SparDLModel:
  """``n`` workers' SparDL with error feedback, one ``step`` at a time."""

  def __init__(self, n: int, num_elements: int, density: float, schedule: str,
               value_dtype=np.float32):
    self.value_dtype = value_dtype  # messages carry values in it; the sender keeps the loss
    self.n = n
    self.N = num_elements
    self.L = -(-num_elements // n)
    self.k_b = max(1, math.floor(density * self.L))
    self.schedule = schedule
    self.residual = np.zeros((n, num_elements), np.float32)

  def step(self, grads: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``grads``: float32 ``[n, N]``. Returns (update ``[N]``, residuals ``[n, N]``)."""
    n, L, k = self.n, self.L, self.k_b  # noqa: N806
    acc = (grads.astype(np.float32) + self.residual).astype(np.float32)
    padded = np.zeros((n, n * L), np.float32)
    padded[:, : self.N] = acc
    original = [[padded[w, b * L : (b + 1) * L].copy() for b in range(n)] for w in range(n)]
    copy = [[original[w][b].copy() for b in range(n)] for w in range(n)]
    local_residual = [[None] * n for _ in range(n)]
    sent_blocks = [set() for _ in range(n)]

    for round_index, round_messages in enumerate(messages(self.schedule, n)):
      inbox = []
      for src, dst, blocks in round_messages:
        for b in blocks:
          assert b != src and b not in sent_blocks[src]
          sent_blocks[src].add(b)
          chosen = top_k(copy[src][b], k)
          values = on_the_wire(copy[src][b][chosen], self.value_dtype)
          dropped = copy[src][b].copy()
          dropped[chosen] -= values
          local_residual[src][b] = dropped
          inbox.append((dst, b, chosen, values))
      for dst in range(n):
        got = [b for d, b, _, _ in inbox if d == dst]
        assert got == expected_receives(self.schedule, n, dst, round_index)
      for dst, b, chosen, values in inbox:
        for i, v in zip(chosen, values, strict=True):
          copy[dst][b][i] = np.float32(copy[dst][b][i] + v)
    for w in range(n):
      assert sent_blocks[w] == set(range(n)) - {w}

    final = []
    for b in range(n):
      chosen = top_k(copy[b][b], k)
      values = on_the_wire(copy[b][b][chosen], self.value_dtype)
      dropped = copy[b][b].copy()
      dropped[chosen] -= values
      local_residual[b][b] = dropped
      final.append((chosen, values))

    update = np.zeros(n * L, np.float32)
    new_residual = np.zeros((n, n * L), np.float32)
    for w in range(n):
      for b in range(n):
        new_residual[w, b * L : (b + 1) * L] = original[w][b]
    for b, (chosen, values) in enumerate(final):
      update[b * L + chosen] = values / np.float32(n)
      for w in range(n):
        new_residual[w, b * L + chosen] = local_residual[w][b][chosen]
    self.residual = new_residual[:, : self.N].copy()
    return update[: self.N].copy(), self.residual.copy()
