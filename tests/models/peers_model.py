"""Independent NumPy models of MiCRO, Top-k, hard threshold, CLT-k and dense.

Written from docs/algorithms.md (the common frame, MiCRO, Top-k, hard
threshold, CLT-k, with its static buffers), not from the JAX code. Every model
takes per-worker flat gradients ``grads[w, t, i]`` (float32, ``n`` workers,
``T`` steps, ``N`` elements) and returns a `Trace`: the aggregated update of
every step, every worker's residual after every step, and the statistics the
JAX transforms report.

Conventions:

* Accumulation ``a_w = g_w + m_w`` is float32; the values at the transmitted
  indices are summed over workers in rank order in float32 and divided by
  ``n`` (JAX's ``psum`` may add in another order: compare updates with a
  tolerance, indices and residuals exactly).
* Index-union exchange (the common frame): every worker clears every transmitted
  index; Top-k and hard threshold take ``unique`` of the union.
* Static buffers: a worker whose selection exceeds its buffer of
  ``C`` slots sends its ``C`` lowest indices; the rest stay in its residual and
  are counted as overflow; the threshold rule sees the true counts.
* MiCRO's threshold follows the published rule in float32:
  ``thr = float32(thr * float32(f))`` with ``f = 1.005`` if ``10 K > 11 k``,
  ``1.00125`` if ``1000 K > 909 k``, else ``0.995``; ``K`` counts 1 for a
  worker that sent only its fallback index.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import ml_dtypes
import numpy as np

F32 = np.float32


class Trace(NamedTuple):
  """What a model did, step by step.

  Attributes:
    updates: float32 ``[T, N]`` aggregated update (the same for every worker).
    residuals: float32 ``[n, T, N]`` each worker's residual after each step.
    threshold: float32 ``[T]`` threshold used (0 where none applies).
    selected: int ``[T]`` elements selected by all workers together.
    transmitted: int ``[T]`` distinct indices transmitted.
    overflow: int ``[T]`` elements that passed but did not fit a buffer.
    workloads: int ``[T, n]`` per partition (MiCRO) or per worker.
  """

  updates: np.ndarray
  residuals: np.ndarray
  threshold: np.ndarray
  selected: np.ndarray
  transmitted: np.ndarray
  overflow: np.ndarray
  workloads: np.ndarray


def target(density: float, num_elements: int) -> int:
  """``k = floor(d N)``."""
  return math.floor(density * num_elements)


def initial_threshold(k: int) -> np.float32:
  """``1 / (2 sqrt(k))``, computed in float64 and rounded to float32."""
  return F32(1.0 / (2.0 * math.sqrt(k)))


def reference_factor(selected: int, k: int) -> np.float32:
  """The published multiplicative threshold update for ``K = selected``."""
  if 10 * selected > 11 * k:
    return F32(1.005)
  if 1000 * selected > 909 * k:
    return F32(1.00125)
  return F32(0.995)


def top_k(magnitudes: np.ndarray, k: int) -> np.ndarray:
  """Indices of the ``k`` largest magnitudes, ties towards the lower index."""
  return np.argsort(-magnitudes, kind="stable")[:k]


def aggregate(accumulated: np.ndarray, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Index-union aggregation (the common frame, steps 4-6) at ``indices`` (any order).

  Returns:
    ``(update [N], residuals [n, N])``.
  """
  num_workers = accumulated.shape[0]
  total = np.zeros(indices.shape, F32)
  for w in range(num_workers):
    total = total + accumulated[w, indices]
  update = np.zeros(accumulated.shape[1], F32)
  update[indices] = total / F32(num_workers)
  residuals = accumulated.copy()
  residuals[:, indices] = 0
  return update, residuals


class _Recorder:
  """Collects per-step records into a `Trace`."""

  def __init__(self):
    self.rows = []

  def add(self, update, residuals, threshold, selected, transmitted, overflow, workloads):
    self.rows.append((update, residuals, threshold, selected, transmitted, overflow, workloads))

  def trace(self) -> Trace:
    cols = list(zip(*self.rows, strict=True))
    return Trace(
        updates=np.stack(cols[0]),
        residuals=np.stack(cols[1], axis=1),
        threshold=np.asarray(cols[2], F32),
        selected=np.asarray(cols[3]),
        transmitted=np.asarray(cols[4]),
        overflow=np.asarray(cols[5]),
        workloads=np.asarray(cols[6]),
    )


def micro_partitions(num_elements: int, num_workers: int) -> tuple[list[int], list[int]]:
  """Static partitions: ``floor(N/n)`` elements, one more for the first ``N mod n``."""
  quotient, extra = divmod(num_elements, num_workers)
  sizes = [quotient + (p < extra) for p in range(num_workers)]
  starts = [sum(sizes[:p]) for p in range(num_workers)]
  return starts, sizes


def _error_feedback(grads: np.ndarray, choose) -> Trace:
  """Steps with error feedback; the update is the workers' mean at the union of their choices.

  ``choose(t, accumulated [n, N])`` returns ``(indices of every worker,
  threshold, selected, overflow, workloads)``; ``transmitted`` is the union's size.
  """
  residuals = np.zeros(grads[:, 0].shape, F32)
  record = _Recorder()
  for t in range(grads.shape[1]):
    accumulated = grads[:, t].astype(F32) + residuals
    indices, threshold, selected, overflow, workloads = choose(t, accumulated)
    union = np.unique(np.concatenate(indices))
    update, residuals = aggregate(accumulated, union)
    record.add(update, residuals, threshold, selected, union.size, overflow, workloads)
  return record.trace()


def topk(grads: np.ndarray, density: float) -> Trace:
  """Top-k with error feedback (Top-k); threshold = min_w k-th magnitude."""
  num_workers, _, num_elements = grads.shape
  k = target(density, num_elements)

  def choose(t, accumulated):
    magnitudes = np.abs(accumulated)
    chosen = [top_k(magnitudes[w], k) for w in range(num_workers)]
    kth = min(magnitudes[w, chosen[w][-1]] for w in range(num_workers))
    return chosen, kth, num_workers * k, 0, [k] * num_workers

  return _error_feedback(grads, choose)


def micro(grads: np.ndarray, density: float, capacity: int) -> Trace:
  """MiCRO (MiCRO) with the published threshold rule."""
  num_workers, _, num_elements = grads.shape
  k = target(density, num_elements)
  starts, sizes = micro_partitions(num_elements, num_workers)
  threshold, previous_selected = initial_threshold(k), None

  def choose(t, accumulated):
    nonlocal threshold, previous_selected
    if t >= 1:
      threshold = F32(threshold * reference_factor(previous_selected, k))
    chosen, workloads = [], [0] * num_workers
    for w in range(num_workers):
      p = (t % num_workers + w) % num_workers
      begin, length = starts[p], sizes[p]
      window = np.abs(accumulated[w, begin : begin + length])
      passing = begin + np.flatnonzero(window >= threshold)
      if passing.size == 0:
        passing = np.asarray([begin + t % length])
      chosen.append(passing[:capacity])
      workloads[p] = passing.size
    previous_selected = selected = sum(workloads)
    overflow = selected - sum(c.size for c in chosen)  # disjoint partitions: the union's size
    return chosen, threshold, selected, overflow, workloads

  return _error_feedback(grads, choose)


def hard_threshold(grads: np.ndarray, threshold: float, capacity: int) -> Trace:
  """Hard threshold (hard threshold) over the whole vector, ``C`` lowest indices kept."""
  threshold = F32(threshold)

  def choose(t, accumulated):
    passing = [np.flatnonzero(np.abs(row) >= threshold) for row in accumulated]
    counts = [p.size for p in passing]
    overflow = sum(max(c - capacity, 0) for c in counts)
    return [p[:capacity] for p in passing], threshold, sum(counts), overflow, counts

  return _error_feedback(grads, choose)


def steered_topk(grads: np.ndarray, k: int, thresholds: np.ndarray) -> Trace:
  """Top-k by thresholds (``topk(exact=False)``): worker ``w`` sends the ``k`` lowest
  indices with ``|a| >= thresholds[t, w]``; the threshold reported is the smallest."""

  def choose(t, accumulated):
    passing = [np.flatnonzero(np.abs(row) >= F32(threshold))
               for row, threshold in zip(accumulated, thresholds[t], strict=True)]
    counts = [p.size for p in passing]
    overflow = sum(max(c - k, 0) for c in counts)
    return [p[:k] for p in passing], F32(np.min(thresholds[t])), sum(counts), overflow, counts

  return _error_feedback(grads, choose)


def cltk(grads: np.ndarray, density: float) -> Trace:
  """CLT-k (CLT-k): the leader ``t mod n``'s top-k, for everyone."""
  num_workers, _, num_elements = grads.shape
  k = target(density, num_elements)

  def choose(t, accumulated):
    leader = t % num_workers
    magnitudes = np.abs(accumulated[leader])
    chosen = top_k(magnitudes, k)
    workloads = [k if w == leader else 0 for w in range(num_workers)]
    return [chosen], magnitudes[chosen[-1]], k, 0, workloads

  return _error_feedback(grads, choose)


def dense(grads: np.ndarray) -> Trace:
  """Mean all-reduce; no residual (reported as zeros)."""
  num_workers, num_steps, num_elements = grads.shape
  record = _Recorder()
  for t in range(num_steps):
    update = np.sum(grads[:, t].astype(F32), axis=0) / F32(num_workers)
    zeros = np.zeros((num_workers, num_elements), F32)
    record.add(update, zeros, 0.0, num_elements, num_elements, 0, [num_elements] * num_workers)
  return record.trace()


def wire_values(values: np.ndarray, values_as) -> np.ndarray:
  """``[chunks, m]`` picked values as the compact wire carries them (docs/algorithms.md).

  A dtype name: in that dtype (float16 clipped to +-65,504). An int ``b``:
  a sign and a level ``q < L = 2**(b-1)`` of ``|v| / s``, read back as
  ``(q + 1/2) / L * s`` (one bit: ``s``). The chunk's scale ``s`` starts at
  its largest magnitude ``M``; three times, the least-squares scale for the
  read-backs ``r`` of the levels taken, ``sum(|v| r) / sum(r**2)``, is
  replaced by the nearest (in ratio) of ``M * 2**(1 - j/16)``, ``j < 112``,
  and the levels are taken anew.
  """
  if not isinstance(values_as, int):
    dtype = {"bfloat16": ml_dtypes.bfloat16}.get(str(values_as), np.dtype(values_as))
    limit = F32(ml_dtypes.finfo(dtype).max) if dtype != np.float32 else np.inf
    return np.clip(values, -limit, limit).astype(dtype).astype(F32)
  levels = F32(2 ** (values_as - 1))
  magnitudes = np.abs(values)
  largest = np.max(magnitudes, axis=1, keepdims=True)
  grid = largest * np.array([2.0 ** (1 - j / 16) for j in range(112)], F32)

  def read_back(scales):
    if values_as == 1:
      return np.ones_like(magnitudes)
    level = np.minimum(np.floor(magnitudes / np.where(scales > 0, scales, F32(1)) * levels),
                       levels - 1)
    return (level + F32(0.5)) / levels

  scales = largest
  for _ in range(3):
    r = read_back(scales)
    fitted = np.sum(magnitudes * r, axis=1, keepdims=True) / np.sum(r * r, axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
      distance = np.abs(np.log(fitted.astype(np.float64) / grid))
    nearest = np.argmin(np.where(np.isnan(distance), 0.0, distance), axis=1)[:, None]
    scales = np.take_along_axis(grid, nearest, axis=1)
  return np.where(values < 0, F32(-1), F32(1)) * read_back(scales) * scales


def chunked_topk(grads: np.ndarray, density: float, chunk: int, values_as) -> Trace:
  """Top ``m = ceil(k / chunks)`` of every chunk per worker; each sends its own values.

  The update is the sum of what the workers sent over ``n``; each worker's
  residual is its accumulated gradient less what it sent (the rounding of
  its values stays in it). The threshold is the smallest magnitude sent.
  """
  num_workers, num_steps, num_elements = grads.shape
  length = min(chunk, num_elements)
  chunks = -(-num_elements // length)
  k = target(density, num_elements)
  per_chunk = length if k == num_elements else min(length, -(-k // chunks))  # 1.0: everything
  residuals = np.zeros((num_workers, num_elements), F32)
  record = _Recorder()
  for t in range(num_steps):
    accumulated = grads[:, t].astype(F32) + residuals
    sent, picked = np.zeros_like(accumulated), np.zeros(accumulated.shape, bool)
    for w in range(num_workers):
      rows = np.zeros(chunks * length, F32)
      rows[:num_elements] = accumulated[w]
      rows = rows.reshape(chunks, length)
      offsets = np.stack([top_k(np.abs(row), per_chunk) for row in rows])
      values = wire_values(np.take_along_axis(rows, offsets, axis=1), values_as)
      indices = (np.arange(chunks)[:, None] * length + offsets).reshape(-1)
      inside = indices < num_elements
      sent[w, indices[inside]] = values.reshape(-1)[inside]
      picked[w, indices[inside]] = True
    update = np.sum(sent, axis=0) / F32(num_workers)
    residuals = accumulated - sent
    record.add(update, residuals.copy(), np.min(np.abs(sent[picked])), num_workers * chunks
               * per_chunk, int(np.sum(np.any(picked, axis=0))), 0, [chunks * per_chunk]
               * num_workers)
  return record.trace()


def chunked_mean_in_bits(grads: np.ndarray, chunk: int, value_bits: int, mean_bits: int
                         ) -> tuple[Trace, np.ndarray]:
  """Every element in ``b`` bits, reduced by each shard's owner and re-rounded in ``mean_bits``.

  The chunks (``L`` elements, the tail zero-padded to ``n c`` chunks) are
  cut into ``n`` shards of ``c``. The mean of what the workers sent,
  plus what the last rounding of the mean lost, is rounded again chunk by
  chunk: that is the update, and what it lost is owed to the next. Each
  worker keeps what the rounding of its own values lost.

  Returns:
    The `Trace`, and float32 ``[T, n, c L]`` the owners' residuals (worker
    ``w``'s is shard ``w`` of the mean's).
  """
  num_workers, num_steps, num_elements = grads.shape
  length = min(chunk, num_elements)
  per_worker = math.ceil(math.ceil(num_elements / length) / num_workers)
  padded = num_workers * per_worker * length
  residuals = np.zeros((num_workers, num_elements), F32)
  owed, owed_trace = np.zeros(padded, F32), []
  record = _Recorder()
  for t in range(num_steps):
    accumulated = grads[:, t].astype(F32) + residuals
    rows = np.zeros((num_workers, padded), F32)
    rows[:, :num_elements] = accumulated
    sent = np.stack([wire_values(row.reshape(-1, length), value_bits).reshape(-1)
                     for row in rows])
    mean = np.mean(sent, axis=0, dtype=F32) + owed
    update = wire_values(mean.reshape(-1, length), mean_bits).reshape(-1)
    owed = mean - update
    residuals = accumulated - sent[:, :num_elements]
    owed_trace.append(owed.reshape(num_workers, -1))
    record.add(update[:num_elements], residuals.copy(), np.min(np.abs(update[:num_elements])),
               num_workers * per_worker * length, num_elements, 0,
               [per_worker * length] * num_workers)
  return record.trace(), np.stack(owed_trace)
