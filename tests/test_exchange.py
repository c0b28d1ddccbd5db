"""The index exchange with a spill: heads all-gathered, tails packed into shared slots.

Each worker's row arrives as if its whole buffer had been all-gathered,
except the indices that fit in neither its head nor the shared slots
(filled one worker after the other); an independent NumPy model says which.
With a spill, the spill is what is sent, and what the statistics count. By
default ExDyna spills where an alpha-beta model of the link says the bytes
it saves outweigh its extra all-reduce.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import exdyna_jax
from exdyna_jax.core import _options
from exdyna_jax.exchange import _exchange, _spill
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
  spill = _spill.Spill(head, slots)

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
  spill = _spill.Spill(4, 10)

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


def test_a_spill_sends_buffer_tails_through_shared_slots():
  """With ``spill=True`` a step's statistics count what was sent: the
  update is nonzero at ``transmitted`` indices, and what passed but was not
  sent is ``overflow``."""
  num_workers, num_elements, density = 8, 40_000, 0.01
  target = int(density * num_elements)
  capacity = _options.capacity(
      _options.default_capacity_factor(target, num_workers, "adaptive"), target, num_workers,
      num_elements,
  )
  spill = _spill.default_spill(target, capacity, num_workers)
  assert spill is not None and spill.head < capacity
  # Worker 3's gradient is 20x the others' at the first step (equal partitions):
  # it passes far more than its head holds and spills into the shared slots.
  grads = np.random.default_rng(0).standard_normal((num_workers, 3, num_elements))
  grads[3] *= 20
  updates, states, _ = harness.run_vmap(
      exdyna_jax.exdyna(density, spill=True), jnp.zeros(num_elements),
      jnp.asarray(grads, jnp.float32),
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


def exchange_seconds(num_workers, capacity, head=None, slots=0):
  """Alpha-beta seconds of the index exchange's collectives on 25 Gb/s at 5 us a message.

  Ring bytes (an all-gather sends ``(n-1) M``, an all-reduce ``2 (n-1) / n M``);
  the latency-optimal message count, ``log2 n`` for an all-gather and ``2
  log2 n`` for an all-reduce (``n`` a power of two). Whole buffers: one
  all-gather of ``C`` slots; a spill: of ``head`` slots and a count, then an
  all-reduce of ``slots`` shared ones.
  """
  rounds = np.log2(num_workers)
  bytes_sent = (num_workers - 1) * 4 * (capacity if head is None else head + 1)
  messages = rounds
  if head is not None:
    bytes_sent += 2 * (num_workers - 1) / num_workers * 4 * slots
    messages += 2 * rounds
  return bytes_sent * 8 / 25e9 + messages * 5e-6


@pytest.mark.parametrize("num_workers", [2, 4, 8, 64])
@pytest.mark.parametrize("num_elements", [40_000, 4_700_000, 11_200_000, 100_000_000])
@pytest.mark.parametrize("density", [0.001, 0.01, 0.1])
def test_the_default_spills_where_the_link_model_says_it_is_faster(
    num_workers, num_elements, density):
  """``spill=None`` picks whole buffers or the spill, whichever the model times shorter."""
  target = int(density * num_elements)
  capacity = _options.capacity(
      _options.default_capacity_factor(target, num_workers, "adaptive"), target, num_workers,
      num_elements,
  )
  head = int(np.ceil(1.2 * target / num_workers))
  slots = max(int(np.ceil(0.3 * target)), capacity - head)
  faster = (exchange_seconds(num_workers, capacity, head, slots)
            < exchange_seconds(num_workers, capacity))
  chosen = _spill.choose_spill(None, target, capacity, num_workers)
  assert (chosen is not None) == faster
  if faster:
    assert chosen == _spill.Spill(head, slots)
  assert _spill.choose_spill(False, target, capacity, num_workers) is None


def test_the_default_sends_whole_buffers_where_k_is_small():
  """At ``k = 400`` on 8 workers the spill's all-reduce costs more than it saves:
  the default exchange is ``spill=False``'s, byte for byte."""
  num_workers, num_elements, density = 8, 40_000, 0.01
  grads = jnp.asarray(
      np.random.default_rng(2).standard_normal((num_workers, 2, num_elements)), jnp.float32
  )
  sent = {}
  for spill in (None, True, False):
    _, states, _ = harness.run_vmap(
        exdyna_jax.exdyna(density, spill=spill), jnp.zeros(num_elements), grads)
    sent[spill] = np.asarray(states.stats.bytes_sent)[0]
  np.testing.assert_array_equal(sent[None], sent[False])
  assert (sent[True] < sent[False]).all()
