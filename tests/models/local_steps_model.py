"""An independent NumPy model of local steps with a compressed outer sync.

Written from the algorithm (DiLoCo, SparseLoCo; ``docs/algorithms.md``), not
from the JAX code. Every worker takes SGD steps with momentum on its own
gradients ``grads[w, t]``; after every ``sync_every``-th step the
pseudo-gradients ``synced - local_w`` are exchanged (their plain mean, or
Top-k with error feedback: the common frame's index-union exchange), the
outer SGD step (momentum, Nesterov) moves the synced parameters, and every
worker continues from them. All arithmetic is float32.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from tests.models.peers_model import F32, aggregate, target, top_k


class LocalTrace(NamedTuple):
  """What the model did, step by step.

  Attributes:
    local: float32 ``[n, T, N]`` each worker's parameters after each step.
    synced: float32 ``[T, N]`` the synced parameters after each step.
    residuals: float32 ``[n, T, N]`` each worker's compressor residual.
  """

  local: np.ndarray
  synced: np.ndarray
  residuals: np.ndarray


def sgd(velocity: np.ndarray, grad: np.ndarray, lr: float, momentum: float, nesterov: bool
        ) -> tuple[np.ndarray, np.ndarray]:
  """optax.sgd's step: ``(step to add, new velocity)``."""
  velocity = grad + F32(momentum) * velocity
  direction = grad + F32(momentum) * velocity if nesterov else velocity
  return -F32(lr) * direction, velocity


def exchange(pseudo: np.ndarray, residuals: np.ndarray, density: float | None
             ) -> tuple[np.ndarray, np.ndarray]:
  """``(aggregate [N], residuals [n, N])``: the mean (``density`` None) or Top-k with EF."""
  if density is None:
    return pseudo.sum(0, dtype=F32) / F32(pseudo.shape[0]), residuals
  accumulated = pseudo + residuals
  k = target(density, pseudo.shape[1])
  union = np.unique(np.concatenate([top_k(np.abs(a), k) for a in accumulated]))
  return aggregate(accumulated, union)


def local_steps(grads: np.ndarray, params: np.ndarray, *, sync_every: int, inner_lr: float,
                inner_momentum: float, density: float | None, outer_lr: float,
                outer_momentum: float, nesterov: bool) -> LocalTrace:
  """Runs ``T`` steps of ``n`` workers from ``params`` ``[N]``; ``grads`` is ``[n, T, N]``."""
  num_workers, num_steps, _ = grads.shape
  local = np.repeat(params[None].astype(F32), num_workers, 0)
  synced = params.astype(F32)
  inner_velocity = np.zeros_like(local)
  residuals = np.zeros_like(local)
  outer_velocity = np.zeros_like(synced)
  rows = []
  for t in range(num_steps):
    step, inner_velocity = sgd(inner_velocity, grads[:, t], inner_lr, inner_momentum, False)
    local = local + step
    if (t + 1) % sync_every == 0:
      mean, residuals = exchange(synced[None] - local, residuals, density)
      step, outer_velocity = sgd(outer_velocity, mean, outer_lr, outer_momentum, nesterov)
      synced = synced + step
      local = np.repeat(synced[None], num_workers, 0)
    rows.append((local, synced, residuals))
  local, synced, residuals = zip(*rows, strict=True)
  return LocalTrace(np.stack(local, 1), np.stack(synced), np.stack(residuals, 1))
