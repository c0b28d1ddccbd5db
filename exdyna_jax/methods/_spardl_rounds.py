"""SparDL's communication rounds: who sends which blocks to whom, and the bytes of each round.

Static, from the number of workers and the schedule: the reduce-scatter
rounds of ``"log"`` (the released code's ``ceil(log2 n)`` rounds) or
``"ring"`` (``n - 1`` steps), and the Bruck all-gather that follows.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax.numpy as jnp

from exdyna_jax.core import _collectives

SCHEDULES = ("log", "ring")


class Round(NamedTuple):
  """One reduce-scatter round, in the rolled frame (row ``j`` = block ``r + j``).

  Rank ``r`` sends rows ``send_rows`` to rank ``r + shift`` and receives rows
  ``recv_rows`` from rank ``r - shift`` (all modulo ``n``).
  """

  shift: int
  send_rows: tuple[int, ...]
  recv_rows: tuple[int, ...]


def log_sizes(num_workers: int) -> list[int]:
  """Blocks per round of the released code's schedule, e.g. ``[2, 2, 1]`` for 6."""
  num_rounds = math.ceil(math.log2(num_workers)) if num_workers > 1 else 0
  if num_rounds == 0:
    return []
  sizes = [2**i for i in range(num_rounds - 1)]
  if num_workers - 2 ** (num_rounds - 1) > 0:
    sizes.append(num_workers - 2 ** (num_rounds - 1))
  return sizes[::-1]


def reduce_scatter_rounds(schedule: str, num_workers: int) -> list[Round]:
  """The reduce-scatter rounds of ``schedule`` for ``num_workers`` ranks."""
  n = num_workers
  if schedule == "ring":
    return [Round(1, ((-s - 1) % n,), ((-s - 2) % n,)) for s in range(n - 1)]
  rounds = []
  sizes = log_sizes(n)
  gap = n - sizes[0] if sizes else 0
  for size in sizes:
    rounds.append(
        Round(gap, tuple((gap + j) % n for j in range(size)), tuple(j % n for j in range(size)))
    )
    gap //= 2
  return rounds


def bruck_sizes(num_workers: int) -> list[int]:
  """Lists forwarded in each round of a Bruck all-gather over ``num_workers``."""
  num_rounds = math.ceil(math.log2(num_workers)) if num_workers > 1 else 0
  return [min(2**j, num_workers - 2**j) for j in range(num_rounds)]


def round_bytes(schedule: str, num_workers: int, per_block: int,
                value_dtype: jnp.dtype) -> tuple[list[int], list[int]]:
  """Bytes one worker sends in each reduce-scatter round and each all-gather round.

  A block's list is ``k_b`` int32 indices and ``k_b`` values of
  ``value_dtype`` packed into int32 words (`_collectives.values_bits`).
  """
  per_list = _collectives.INDEX_BYTES * (
      per_block + _collectives.words_of(per_block, value_dtype))
  return ([len(r.send_rows) * per_list for r in reduce_scatter_rounds(schedule, num_workers)],
          [size * per_list for size in bruck_sizes(num_workers)])
