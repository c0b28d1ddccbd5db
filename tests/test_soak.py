"""A short soak in the test suite: a few hundred steps of every method, no drift.

``benchmarks/soak.py`` runs the full version (10,000 steps per method); this
runs the same checks on 200 steps: threshold finite and positive, partitions
within bounds, no skipped steps, residual bounded, and every device's own
copy of the parameters bit-identical to the others'.
"""

from __future__ import annotations

import numpy as np
import pytest

import exdyna_jax
from benchmarks import soak

pytestmark = pytest.mark.slow  # the tools end to end: `-m "not slow"` leaves them out


@pytest.mark.parametrize("method", exdyna_jax.available_sparsifiers())
def test_short_soak_is_sound(method):
  figures = soak.soak(method, steps=200, num_workers=4, chunk=100)
  assert figures["problems"] == []
  assert figures["loss_last_10pct"] < figures["loss_first_100"]
  if method != "dense":
    assert 0 < figures["residual_norm_final"] < float("inf")


def test_soak_checks_can_fail():
  """The checker is not vacuous: diverged copies and a bad threshold are caught."""
  stats = exdyna_jax.SparsifierStats(
      step=np.ones((2, 3), np.int32),
      threshold=np.array([[0.1, np.nan, 0.1], [0.1, np.nan, 0.1]], np.float32),
      selected=np.ones((2, 3), np.int32),
      transmitted=np.ones((2, 3), np.int32),
      overflow=np.zeros((2, 3), np.int32),
      workloads=np.ones((2, 3, 2), np.int32),
      imbalance=np.ones((2, 3), np.float32),
      partition_starts=np.zeros((2, 3, 2), np.int32),
      partition_sizes=np.full((2, 3, 2), 10, np.int32),
      bytes_sent=np.ones((2, 3), np.int32),
      target=np.ones((2, 3), np.int32),
      nonfinite=np.zeros((2, 3), np.int32),
      skipped_steps=np.zeros((2, 3), np.int32),
  )
  records = {"stats": stats, "residual_norm": np.ones((2, 3), np.float32)}
  params = {"w": np.array([[1.0, 2.0], [1.0, 2.5]])}
  problems = soak.check_chunk("topk", records, params, num_elements=10, num_workers=2)
  assert any("threshold" in p for p in problems)
  assert any("diverged" in p for p in problems)
