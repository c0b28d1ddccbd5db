"""ExDyna on a network where messages are dear: the probe counts ride the index buffers.

Told a ``Network`` on which one all-gather more costs more than the
magnitudes it adds, ExDyna's workers select before the threshold is set, at
their *floor* (the lowest probe whose count fits the ``C`` buffer slots),
and one all-gather moves each worker's probe counts with its buffer and the
magnitudes in it. Every worker then sets the threshold from the counts and
keeps what passes. Where every buffer holds all that passes, that is exactly
what selecting at the threshold sends; where one does not, the step selects
and gathers again. So the run is the two-round run, one round shorter.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import exdyna_jax
from exdyna_jax import hlo
from exdyna_jax.exchange import _network
from exdyna_jax.methods.exdyna import _balance, _early_selection, _exdyna, _exdyna_step
from exdyna_jax.selection import _threshold
from tests import harness
from tests.test_network import GLOO_1GBIT, one_step_program


def model_floor_and_buffer(accumulated, begin, end, previous, capacity):
  """NumPy: the probes, the floor, and the buffer one worker sends (lowest ``C`` indices)."""
  thresholds = np.float32(previous) * np.asarray(_threshold.ADAPTIVE_PROBE_RATIOS, np.float32)
  magnitudes = np.abs(accumulated[begin:end])
  counts = np.array([(magnitudes >= t).sum() for t in thresholds])
  fitting = np.flatnonzero(counts <= capacity)
  floor = thresholds[fitting[0] if fitting.size else -1]
  buffer = begin + np.flatnonzero(magnitudes >= floor)[:capacity]
  return thresholds, counts, floor, buffer


def model_keep(accumulated, buffer, threshold, fallback, num_elements, capacity):
  """NumPy: the buffered indices that pass, sentinel-padded to ``C``, and how many."""
  kept = [i for i in buffer if abs(accumulated[i]) >= threshold]
  row = np.full(capacity, num_elements)
  row[np.searchsorted(buffer, kept)] = kept
  if not kept:
    row[0] = fallback
  return row, len(kept)


MODEL_CASE = {"num_elements": 4096, "capacity": 40, "step": 5, "previous": 6.0}


@functools.cache
def early_step():
  """The workers' `_early_selection` steps at one threshold, under ``vmap``, compiled once."""
  case = MODEL_CASE

  def per_worker(accumulated, begin, end, threshold):
    candidates = _early_selection.gather_candidates(
        accumulated, jnp.float32(case["previous"]), begin, end, capacity=case["capacity"],
        chunk=1024, unrolled=0, fallback_offset=jnp.int32(case["step"]), axis_name=harness.AXIS)
    indices, passed = _early_selection.keep_passing(candidates, threshold, case["num_elements"])
    decided = _early_selection.holds_every_pass(candidates, threshold, case["capacity"])
    return candidates, indices, passed, decided

  return jax.jit(jax.vmap(per_worker, in_axes=(0, 0, 0, None), axis_name=harness.AXIS))


@pytest.mark.parametrize(("scale", "threshold_octaves", "holds"), [
    (3.0, 0.7, True),  # above every floor
    (3.0, 3.0, True),  # above every probe: the few largest
    (3.0, 0.2, False),  # below worker 2's floor (half an octave up)
    (3.0, -3.0, False),  # below every probe
    (8.0, 3.0, False),  # no probe's count fits worker 2's buffer
])
def test_the_gathered_buffers_and_what_passes_follow_the_numpy_model(
    scale, threshold_octaves, holds):
  """4 workers, uneven partitions; worker 2's gradient is ``scale`` times
  larger, so its floor lies above the others' (or no probe fits it)."""
  num_workers = 4
  num_elements, capacity, step = (MODEL_CASE[key] for key in ("num_elements", "capacity", "step"))
  rng = np.random.default_rng(0)
  accumulated = rng.standard_t(3.0, (num_workers, num_elements)).astype(np.float32)
  accumulated[2] *= scale
  cuts = np.array([0, 300, 2500, 3100, num_elements])
  begins, ends = cuts[:-1], cuts[1:]
  previous = np.float32(MODEL_CASE["previous"])
  threshold = np.float32(previous * 2.0**threshold_octaves)
  candidates, indices, passed, decided = early_step()(
      jnp.asarray(accumulated), jnp.asarray(begins, jnp.int32), jnp.asarray(ends, jnp.int32),
      jnp.float32(threshold))
  # Every worker holds the same gathered result: compare worker 0's.
  expected_holds = True
  for w in range(num_workers):
    thresholds, counts, floor, buffer = model_floor_and_buffer(
        accumulated[w], begins[w], ends[w], previous, capacity)
    fallback = begins[w] + step % (ends[w] - begins[w])
    row, count = model_keep(accumulated[w], buffer, threshold, fallback, num_elements, capacity)
    np.testing.assert_array_equal(candidates.probe.counts[0, w], counts)
    assert candidates.floors[0, w] == floor
    np.testing.assert_array_equal(
        candidates.indices[0, w], np.pad(buffer, (0, capacity - buffer.size),
                                         constant_values=num_elements))
    np.testing.assert_array_equal(
        candidates.magnitudes[0, w, :buffer.size], np.abs(accumulated[w, buffer]))
    np.testing.assert_array_equal(indices[0, w], row)
    assert passed[0, w] == count
    expected_holds &= bool(counts[-1] <= capacity and threshold >= floor)
  np.testing.assert_array_equal(_threshold.probe_thresholds(previous), thresholds)
  assert candidates.probe.largest[0] == max(
      np.abs(accumulated[w, begins[w]:ends[w]]).max() for w in range(num_workers))
  assert bool(decided[0]) == expected_holds == holds


def pricing(network, num_workers, capacity, probes):
  """The alpha-beta model written out: one all-gather of both, against one of each."""
  rounds = int(np.ceil(np.log2(num_workers)))

  def gather(words):
    return rounds * network.message_seconds + (num_workers - 1) * 4 * words / (
        network.bytes_per_second)

  merged = gather(probes + 1 + 2 * capacity + 2)
  return merged < gather(probes + 1) + gather(capacity + 1)


@pytest.mark.parametrize("network", [_network.NOMINAL, GLOO_1GBIT])
@pytest.mark.parametrize(("num_elements", "num_workers", "density"), [
    (4_743_178, 4, 0.001), (11_200_000, 8, 0.001), (1_000_000, 64, 0.01), (40_000, 4, 0.01)])
def test_the_probe_round_is_merged_where_the_model_says_it_pays(
    network, num_elements, num_workers, density):
  plan = functools.partial(
      _exdyna_step.plan_step, density, num_elements, num_workers,
      partitioner=_balance.BALANCED, num_blocks=None, capacity_factor=None, spill=False,
      controller=_threshold.get_controller("adaptive"))
  capacity = plan().budget.capacity
  assert plan(network=network).select_first == pricing(
      network, num_workers, capacity, len(_threshold.ADAPTIVE_PROBE_RATIOS))
  assert not plan().select_first  # without a network: the published order
  reference = plan(network=network, controller=_threshold.get_controller("reference"))
  assert not reference.select_first  # no probes: nothing to merge


def test_a_slow_network_merges_the_rounds_a_fast_one_keeps_them():
  """The 4.7M MLP at d = 0.001 on 4 workers: merged on gloo at 1 Gb/s; 11.2M
  on 8 workers (C = 3,500 magnitudes more) not on the 25 Gb/s, 5 us link."""
  adaptive = _threshold.get_controller("adaptive")
  common = {"partitioner": _balance.BALANCED, "num_blocks": None, "capacity_factor": None,
            "controller": adaptive, "spill": None}
  assert _exdyna_step.plan_step(0.001, 4_743_178, 4, network=GLOO_1GBIT, **common).select_first
  assert not _exdyna_step.plan_step(
      0.001, 11_200_000, 8, network=_network.NOMINAL, **common).select_first


@pytest.fixture
def holds_record(monkeypatch):
  """What `holds_every_pass` decided at each step, as the compiled run saw it."""
  record = []
  original = _early_selection.holds_every_pass

  def recording(candidates, threshold, capacity):
    holds = original(candidates, threshold, capacity)
    jax.debug.callback(lambda h: record.append(bool(h)), holds)
    return holds

  monkeypatch.setattr(_early_selection, "holds_every_pass", recording)
  return record


@pytest.mark.parametrize("value_dtype", [jnp.float32, jnp.bfloat16])
def test_one_round_fewer_sends_what_two_rounds_send(holds_record, monkeypatch, value_dtype):
  """20 steps on 4 workers: heavy-tailed gradients, 30x larger on one worker
  and on the last eighth of ``N``, the scale jumping 50x at step 8 and
  back at step 14. Updates and every state field equal the run that selects
  after the threshold (same network, so the values are gathered in both); the
  first step and the jumps select again, the others do not."""
  num_workers, num_elements, steps = 4, 40_000, 20
  rng = np.random.default_rng(7)
  grads = rng.standard_t(3.0, (num_workers, steps, num_elements)).astype(np.float32)
  grads[1] *= 30
  grads[:, :, -num_elements // 8:] *= 30
  grads[:, 8:14] *= 50
  tx = exdyna_jax.exdyna(0.01, network=GLOO_1GBIT, value_dtype=value_dtype)
  params = jnp.zeros(num_elements)
  one_round = harness.to_numpy(harness.run_shard_map(tx, params, jnp.asarray(grads))[:2])
  assert True in holds_record and False in holds_record
  with monkeypatch.context() as patch:  # the same ExDyna, planned to select after the threshold
    plan_step = _exdyna_step.plan_step
    patch.setattr(_exdyna, "plan_step",
                  lambda *a, **k: plan_step(*a, **k)._replace(select_first=False))
    published = exdyna_jax.exdyna(0.01, network=GLOO_1GBIT, value_dtype=value_dtype)
    two_rounds = list(harness.to_numpy(
        harness.run_shard_map(published, params, jnp.asarray(grads))[:2]))
  # The bytes differ by what rides along: each worker's magnitudes and floor,
  # its fallback index for its pass count.
  capacity = _exdyna_step.plan_step(
      0.01, num_elements, num_workers, partitioner=_balance.BALANCED, num_blocks=None,
      capacity_factor=None, controller=_threshold.get_controller("adaptive"), spill=None,
      network=GLOO_1GBIT).budget.capacity
  stats, two_rounds_stats = one_round[1].stats, two_rounds[1].stats
  np.testing.assert_array_equal(
      stats.bytes_sent - two_rounds_stats.bytes_sent, (num_workers - 1) * 4 * (capacity + 1))
  two_rounds[1] = two_rounds[1]._replace(stats=two_rounds_stats._replace(
      bytes_sent=stats.bytes_sent, bytes_total=stats.bytes_total))
  jax.tree.map(np.testing.assert_array_equal, one_round, tuple(two_rounds))
  # A run the controller holds near k, the jumps aside.
  assert abs(np.median(stats.transmitted) / stats.target[0, 0] - 1) < 0.05


def test_the_compiled_step_has_one_gather_fewer_and_counts_its_bytes():
  """The guard's flags, the counts with the buffers, the values; the second
  gather of a step that selects again is in the program but not a step's."""
  num_workers, num_elements = 4, 40_000
  tx = exdyna_jax.exdyna(0.01, network=GLOO_1GBIT)
  program = one_step_program(tx, num_workers, num_elements)
  assert [c.kind for c in hlo.collectives(program, num_workers)] == [
      "all-reduce", "all-gather", "all-gather"]
  assert program.count("all-gather-start") + program.count(" all-gather(") >= 3
  grads = jnp.ones((num_workers, 1, num_elements))
  _, states, _ = harness.run_shard_map(tx, jnp.zeros(num_elements), grads)
  assert hlo.bytes_per_worker(program, num_workers) == int(states.stats.bytes_sent[0, 0])
