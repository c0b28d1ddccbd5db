"""The index exchange with a spill: heads all-gathered, tails packed into shared slots.

Each worker's row arrives as if its whole buffer had been all-gathered,
except the indices that fit in neither its head nor the shared slots
(filled one worker after the other); an independent NumPy model says which.
Under the default ExDyna the spill is what is sent, and what the statistics
count.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import exdyna_jax
from exdyna_jax import _exchange, _options
from tests import harness

NUM_ELEMENTS = 1_000


def spilled_rows_model(buffers: np.ndarray, head: int, slots: int) -> np.ndarray:
  """What every worker receives: each row's first ``head`` indices, then its
  other indices while the ``slots`` shared ones last, worker 0's first."""
  received = np.full_like(buffers, NUM_ELEMENTS)
  free = slots
  for w, row in enumerate(buffers):
    chosen = row[row < NUM_ELEMENTS]
    received[w, : min(head, chosen.size)] = chosen[:head]
    tail = chosen[head:][:free]
    received[w, head : head + tail.size] = tail
    free -= tail.size
  return received


def random_buffers(rng, counts, capacity):
  buffers = np.full((len(counts), capacity), NUM_ELEMENTS, np.int32)
  for w, count in enumerate(counts):
    buffers[w, :count] = np.sort(rng.choice(NUM_ELEMENTS, count, replace=False))
  return buffers


@pytest.mark.parametrize("seed", range(4))
def test_spilled_rows_are_the_gathered_rows_less_what_found_no_slot(seed):
  rng = np.random.default_rng(seed)
  num_workers, capacity = 6, 12
  head, slots = int(rng.integers(1, capacity)), int(rng.integers(1, 20))
  counts = rng.integers(0, capacity + 1, num_workers)
  buffers = random_buffers(rng, counts, capacity)
  side_info = rng.integers(0, 100, (num_workers, 2)).astype(np.int32)
  spill = _exchange.Spill(head, slots)

  def gather(indices, info):
    return _exchange.gather_indices(
        indices, info, harness.AXIS, spill=spill, num_elements=NUM_ELEMENTS
    )

  rows, info = jax.vmap(gather, axis_name=harness.AXIS)(jnp.asarray(buffers), side_info)
  expected = spilled_rows_model(buffers, head, slots)
  for worker in range(num_workers):  # identical on every worker
    np.testing.assert_array_equal(rows[worker], expected, err_msg=str((head, slots, counts)))
    np.testing.assert_array_equal(info[worker], side_info)


def test_the_spill_runs_under_shard_map_with_varying_types_checked():
  rng = np.random.default_rng(7)
  buffers = random_buffers(rng, [9, 0, 3, 12, 1, 7, 12, 2], 12)
  spill = _exchange.Spill(4, 10)

  def gather(indices):
    return _exchange.gather_indices(
        indices[0], jnp.zeros((0,), jnp.int32), harness.AXIS, spill=spill,
        num_elements=NUM_ELEMENTS,
    )[0]

  mesh = harness.mesh_of(8)
  rows = jax.jit(jax.shard_map(
      gather, mesh=mesh, in_specs=jax.P(harness.AXIS), out_specs=jax.P(), check_vma=True
  ))(jnp.asarray(buffers))
  np.testing.assert_array_equal(rows, spilled_rows_model(buffers, 4, 10))


def test_default_exdyna_sends_buffer_tails_through_shared_slots():
  """The defaults spill, and a step's statistics count what was sent: the
  update is nonzero at ``transmitted`` indices, and what passed but was not
  sent is ``overflow``."""
  num_workers, num_elements, density = 8, 40_000, 0.01
  target = int(density * num_elements)
  capacity = _options.capacity(
      _options.default_capacity_factor(target, num_workers, "adaptive"), target, num_workers,
      num_elements,
  )
  spill = _exchange.default_spill(target, capacity, num_workers)
  assert spill is not None and spill.head < capacity
  # Worker 3's gradient is 20x the others' at the first step (equal partitions):
  # it passes far more than its head holds and spills into the shared slots.
  grads = np.random.default_rng(0).standard_normal((num_workers, 3, num_elements))
  grads[3] *= 20
  updates, states, _ = harness.run_vmap(
      exdyna_jax.exdyna(density), jnp.zeros(num_elements), jnp.asarray(grads, jnp.float32)
  )
  stats = jax.tree.map(lambda x: np.asarray(x)[0], states.stats)
  updates = np.asarray(updates)[0]
  sent = (updates != 0).sum(axis=1)
  np.testing.assert_array_equal(sent, stats.transmitted)
  heads = np.minimum(stats.workloads[0], spill.head).sum()
  assert stats.transmitted[0] > heads, "the tails past the heads were sent too"
  np.testing.assert_array_equal(stats.overflow, stats.selected - stats.transmitted)


def test_without_the_spill_buffers_are_gathered_whole_for_more_bytes():
  """``spill=False`` gathers whole buffers: the same density sent, more bytes."""
  num_workers, num_elements, density = 8, 40_000, 0.01
  grads = jnp.asarray(
      np.random.default_rng(1).standard_normal((num_workers, 8, num_elements)), jnp.float32
  )
  stats = {}
  for spill in (True, False):
    tx = exdyna_jax.exdyna(density, spill=spill)
    _, states, _ = harness.run_vmap(tx, jnp.zeros(num_elements), grads)
    stats[spill] = jax.tree.map(lambda x: np.asarray(x)[0], states.stats)
  target = int(density * num_elements)
  for spill in (True, False):
    sent = stats[spill].transmitted[3:] / target  # after the first steps' transient
    assert (np.abs(sent - 1) <= 0.1).all(), (spill, sent)
  assert (stats[True].bytes_sent < 0.9 * stats[False].bytes_sent).all()
