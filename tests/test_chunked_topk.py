"""`chunked_topk`: top-m of every chunk, 16-bit offsets and 2-32-bit values, against a NumPy model.

The wire is checked on its own (what a message holds and its length) and
in the compiled step (one all-gather of bytes, no all-reduce of values);
the method step by step against `peers_model.chunked_topk`.
"""

from __future__ import annotations

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import exdyna_jax
from exdyna_jax import hlo
from exdyna_jax.exchange import _packed
from tests import harness
from tests.models import peers_model

NUM_WORKERS, NUM_STEPS = 4, 10
SHAPES = {"b": (64,), "w": (32, 65)}  # N = 2144
PARAMS = {name: jnp.zeros(shape, jnp.float32) for name, shape in SHAPES.items()}
NUM_ELEMENTS = sum(math.prod(shape) for shape in SHAPES.values())

# (a value dtype or bits, chunk, density, runner): 5 chunks of 512 (the last of 96); one
# chunk (a model smaller than it); 2 chunks whose last (144 elements) is
# smaller than the 214 picks a chunk, so padding is picked and dropped. The workers' picks
# are summed through a sort of them (density 0.05: 440 of N = 2144), or through [N] buffers
# where they are N / 4 or more (0.2: 1712; 0.25: 2160).
CASES = {
    "float32": ("float32", 512, 0.05, "vmap"),
    "bfloat16": ("bfloat16", 512, 0.05, "vmap"),
    "float16": ("float16", 512, 0.05, "vmap"),
    "8_bits_padding_picked": (8, 2000, 0.2, "vmap"),
    "4_bits_one_chunk": (4, 4096, 0.05, "vmap"),
    "2_bits": (2, 512, 0.05, "vmap"),
    "2_bits_shard_map": (2, 512, 0.05, "shard_map"),
    "2_bits_many_picks_shard_map": (2, 512, 0.25, "shard_map"),
    "1_bit": (1, 512, 0.05, "vmap"),
    "1_bit_every_element": (1, 512, 1.0, "shard_map"),  # whole chunks: no offsets
}


def flat_gradients(seed: int = 0) -> np.ndarray:
  """``[n, T, N]`` heavy-tailed gradients, larger towards the vector's end, per worker apart."""
  rng = np.random.default_rng(seed)
  scale = 0.01 * np.exp(np.linspace(0.0, 1.5, NUM_ELEMENTS))
  noise = rng.standard_t(3, size=(NUM_WORKERS, NUM_STEPS, NUM_ELEMENTS))
  return (noise * scale * (1.0 + 0.25 * np.arange(NUM_WORKERS))[:, None, None]).astype(np.float32)


@functools.cache
def run_case(case: str):
  values_as, chunk, density, runner = CASES[case]
  options = {"value_dtype": values_as} if isinstance(values_as, str) else {"value_bits": values_as}
  tx = exdyna_jax.chunked_topk(density, chunk=chunk, **options)
  grads = flat_gradients()
  run = (harness.run_vmap if runner == "vmap"
         else functools.partial(harness.run_shard_map, check_vma=True))
  updates, states, _ = run(tx, PARAMS, harness.unflatten_like(grads, PARAMS))
  flat = np.concatenate([np.asarray(leaf).reshape(NUM_WORKERS, NUM_STEPS, -1)
                         for leaf in jax.tree.leaves(updates)], axis=-1)
  return grads, flat, harness.to_numpy(states), peers_model.chunked_topk(
      grads, density, chunk, values_as)


def compiled_step(tx, grads) -> str:
  """The text of ``tx``'s steps over ``grads`` compiled under ``shard_map``, a worker a device."""
  per_worker = harness._scan_steps(tx, PARAMS)
  step = jax.jit(jax.shard_map(
      lambda g: jax.tree.map(lambda x: x[None], per_worker(jax.tree.map(lambda x: x[0], g))),
      mesh=harness.mesh_of(NUM_WORKERS), in_specs=jax.P(harness.AXIS),
      out_specs=jax.P(harness.AXIS)))
  return step.lower(grads).compile().as_text()


@pytest.mark.parametrize("case", CASES)
def test_matches_the_numpy_model_step_by_step(case):
  grads, updates, states, trace = run_case(case)
  for w in range(1, NUM_WORKERS):  # one update, the same on every worker
    np.testing.assert_array_equal(updates[w], updates[0])
  np.testing.assert_allclose(updates[0], trace.updates, rtol=1e-6, atol=1e-9)
  np.testing.assert_array_equal(states.residual, trace.residuals)  # each its own: exact
  previous = np.concatenate([np.zeros_like(trace.residuals[:, :1]), trace.residuals[:, :-1]], 1)
  np.testing.assert_allclose(  # nothing lost: sum_w m_w + n u == sum_w a_w
      np.sum(states.residual, 0) + NUM_WORKERS * updates[0], np.sum(grads + previous, 0),
      rtol=1e-5, atol=1e-6)
  stats = states.stats
  for field in ("selected", "transmitted", "overflow", "workloads"):
    np.testing.assert_array_equal(getattr(stats, field)[0], getattr(trace, field), err_msg=field)
  np.testing.assert_array_equal(stats.threshold[0], trace.threshold)
  if CASES[case][2] == 1.0:
    np.testing.assert_array_equal(trace.transmitted, NUM_ELEMENTS)
  else:
    assert np.all(trace.transmitted > trace.workloads[:, 0])  # the workers disagree: a union


def test_fewer_value_bits_round_more_and_keep_the_rest():
  """What the rounding takes stays in the residuals: 2-bit updates differ from
  float32's at the same picks, and the sent values carry fewer distinct levels."""
  _, exact, _, _ = run_case("float32")
  _, coarse, states, _ = run_case("2_bits")
  np.testing.assert_array_equal(exact[0, 0] != 0, coarse[0, 0] != 0)  # the same first picks
  assert not np.allclose(exact[0, 0], coarse[0, 0])
  assert np.all(states.stats.threshold > 0)


@pytest.mark.parametrize("values_as", [*_packed.VALUE_BITS, "bfloat16", "float16", "float32"])
@pytest.mark.parametrize(("chunks", "per_chunk", "length", "offset_bits"), [
    (3, 7, 4096, 12), (1, 1, 1, 1), (5, 64, _packed.MAX_CHUNK, 16), (2, 3, 1000, 10)])
def test_a_message_decodes_to_what_the_wire_carries(values_as, chunks, per_chunk, length,
                                                    offset_bits):
  """`decode(encode(picks))` gives the picks' offsets and their rounded values,
  and the message is `message_bytes` long: the offsets in ``ceil(log2 L)`` bits
  each, the values after them (odd counts of bits pad a byte)."""
  values_as = values_as if isinstance(values_as, int) else np.dtype(jnp.dtype(values_as))
  rng = np.random.default_rng(chunks * per_chunk)
  offsets = rng.integers(0, length, (chunks, per_chunk))
  offsets.flat[0] = length - 1  # the largest offset uses every bit
  picks = _packed.Picks(jnp.asarray(offsets, jnp.int32),
                        jnp.asarray(rng.standard_normal((chunks, per_chunk)) * 1e5, jnp.float32))
  message = _packed.encode(picks, length, values_as)
  assert message.dtype == jnp.uint8
  picks_count = chunks * per_chunk
  value_bytes = (-(-picks_count * values_as // 8) + 4 * chunks if isinstance(values_as, int)
                 else values_as.itemsize * picks_count)
  assert _packed.offset_bits(length) == offset_bits
  stream = np.packbits(((offsets.reshape(-1, 1) >> np.arange(offset_bits)) & 1).astype(np.uint8),
                       bitorder="little")  # each offset's bits, least significant first
  if per_chunk == length:  # whole chunks, every element in place: no offsets
    stream = stream[:0]
  assert message.shape == (_packed.message_bytes(chunks, per_chunk, length, values_as),) == (
      stream.size + value_bytes,)
  np.testing.assert_array_equal(message[: stream.size], stream)
  decoded = _packed.decode(message[None], chunks, per_chunk, length, values_as)
  np.testing.assert_array_equal(decoded.offsets[0], picks.offsets)
  np.testing.assert_array_equal(decoded.values[0], _packed.rounded(picks.values, values_as))
  np.testing.assert_array_equal(
      decoded.values[0], peers_model.wire_values(np.asarray(picks.values), values_as))
  if isinstance(values_as, int):  # at most 2**(b-1) magnitudes in a chunk
    assert all(len(np.unique(np.abs(row))) <= 2 ** (values_as - 1) for row in decoded.values[0])
  assert np.all(np.isfinite(decoded.values))  # float16 clipped to its range, not infinite


@pytest.mark.parametrize("value_bits", _packed.VALUE_BITS)
def test_each_chunk_scale_is_fitted_by_least_squares_on_a_grid(value_bits):
  """The scale is the chunk's largest magnitude times ``2**(1 - j/16)``, and
  rounding on it loses no more than on the largest magnitude, the scale
  before the fit; on heavy-tailed values (Student's t, 3 degrees of
  freedom) 2 bits lose at most half of that, and one bit as much as
  the sign on the chunk's mean magnitude, to within the grid."""
  values = np.random.default_rng(value_bits).standard_t(3, (16, 1024)).astype(np.float32)
  _, scales = _packed.quantize(jnp.asarray(values), value_bits)
  largest = np.abs(values).max(1)
  steps = 16 * (1 - np.log2(np.asarray(scales) / largest))
  np.testing.assert_allclose(steps, np.round(steps), atol=1e-3)

  def lost(rounded):
    return np.sum((values - rounded) ** 2)

  levels = 2 ** (value_bits - 1)  # the nearest level on the largest magnitude
  on_largest = np.sign(values) * largest[:, None] * (1 if value_bits == 1 else (np.minimum(
      np.floor(np.abs(values) / largest[:, None] * levels), levels - 1) + 0.5) / levels)
  fitted = lost(np.asarray(_packed.rounded(jnp.asarray(values), value_bits)))
  assert fitted <= lost(on_largest)
  if value_bits == 2:
    assert fitted <= 0.5 * lost(on_largest)
  if value_bits == 1:
    mean_sign = np.sign(values) * np.abs(values).mean(1, keepdims=True)
    assert fitted <= 1.001 * lost(mean_sign)


def test_the_wire_is_one_all_gather_of_bytes():
  """The compiled step moves the picks as bytes (offsets, codes, scales) in one
  all-gather of ``message_bytes``, and sums no values with an all-reduce: the
  stats' bytes are that all-gather's on a ring, beside the guard's screen."""
  tx = exdyna_jax.chunked_topk(0.05, chunk=512, value_bits=2)
  grads = harness.unflatten_like(flat_gradients()[:, :1], PARAMS)
  text = compiled_step(tx, grads)
  message = _packed.message_bytes(5, 22, 512, 2)  # ceil(107 / 5) = 22 picks a chunk of 512
  gathers = re.findall(r"u8\[(\d+),?(\d*)\]\S* all-gather\(", text)
  assert [int(size) for pair in gathers for size in pair if size] == [NUM_WORKERS, message]
  assert not re.search(r"f32\[\d+\]\S* all-reduce\(", text)
  _, _, states, _ = run_case("2_bits")
  screen = int(states.stats.bytes_sent[0, 0]) - (NUM_WORKERS - 1) * message
  assert 0 < screen < 64


def test_every_element_in_low_bits_goes_without_offsets():
  """At density 1.0 with ``value_bits`` each worker sends every element of each
  chunk, in place, so its message is the codes and the scales only (``N b / 8``
  bytes and 4 a chunk); with float values 1.0 stays the exact dense mean, and
  in a schedule a level of 1.0 is dense whatever the values."""
  _, _, states, _ = run_case("1_bit_every_element")
  message = _packed.message_bytes(5, 512, 512, 1)
  assert message == 5 * 512 // 8 + 5 * 4
  screen = int(states.stats.bytes_sent[0, 0]) - (NUM_WORKERS - 1) * message
  assert 0 < screen < 64
  grads = flat_gradients()[:, :3]
  dense, _, _ = harness.run_vmap(exdyna_jax.dense(), PARAMS, harness.unflatten_like(grads, PARAMS))
  for tx in (exdyna_jax.chunked_topk(1.0, chunk=512),
             exdyna_jax.chunked_topk({0: 1.0, 2: 0.05}, chunk=512, value_bits=1)):
    updates, _, _ = harness.run_vmap(tx, PARAMS, harness.unflatten_like(grads, PARAMS))
    for got, want in zip(jax.tree.leaves(updates), jax.tree.leaves(dense), strict=True):
      np.testing.assert_allclose(got[:, :2], want[:, :2], rtol=1e-6, atol=1e-9)


def test_every_element_on_the_all_reduce_wire_matches_the_numpy_model():
  """``wire="all_reduce"``: each worker sends every shard's owner its chunks
  there in ``b`` bits (one all-to-all of bytes), each owner gathers back the
  mean in ``mean_bits`` (by default ``2 b``), keeping what that rounding
  loses; nothing else moves, and the stats count what XLA compiled: ``n -
  1`` shard messages in each pass."""
  tx = exdyna_jax.chunked_topk(1.0, chunk=256, value_bits=1, wire="all_reduce")
  grads = flat_gradients()
  run = functools.partial(harness.run_shard_map, check_vma=True)
  updates, states, _ = harness.to_numpy(run(tx, PARAMS, harness.unflatten_like(grads, PARAMS)))
  updates = np.concatenate([leaf.reshape(NUM_WORKERS, NUM_STEPS, -1)
                            for leaf in jax.tree.leaves(updates)], axis=-1)
  trace, owed = peers_model.chunked_mean_in_bits(grads, 256, 1, 2)
  for w in range(NUM_WORKERS):
    np.testing.assert_allclose(updates[w], trace.updates, rtol=1e-6, atol=1e-9)
  np.testing.assert_allclose(states.residual, trace.residuals, rtol=1e-6, atol=1e-9)
  np.testing.assert_allclose(states.shard_residual.swapaxes(0, 1), owed, rtol=1e-6, atol=1e-9)
  kept = states.residual[:, -1].sum(0) + NUM_WORKERS * states.shard_residual[:, -1].reshape(-1)[
      :NUM_ELEMENTS]
  np.testing.assert_allclose(kept + NUM_WORKERS * updates[0].sum(0), grads.sum((0, 1)),
                             rtol=1e-5, atol=1e-4)  # nothing lost between the two roundings

  text = compiled_step(tx, harness.unflatten_like(grads[:, :1], PARAMS))
  sent, mean = (_packed.message_bytes(3, 256, 256, bits) for bits in (1, 2))  # 9 chunks: 3 each
  ops = hlo.collectives(text, NUM_WORKERS)
  assert [(op.kind, {dtype for dtype, _ in op.shapes}, op.result_bytes) for op in ops
          if op.kind != "all-reduce"] == [("all-to-all", {"u8"}, NUM_WORKERS * sent),
                                          ("all-gather", {"u8"}, NUM_WORKERS * mean)]
  assert not re.search(r"f32\[\d+\]\S* all-reduce\(", text)
  assert hlo.bytes_per_worker(text, NUM_WORKERS) == states.stats.bytes_sent[0, 0]
  screen = states.stats.bytes_sent[0, 0] - (NUM_WORKERS - 1) * (sent + mean)
  assert 0 < screen < 64


@pytest.mark.parametrize(("options", "message"), [
    ({"chunk": 65537}, "chunk must be at most 65536"),
    ({"chunk": 0}, "chunk must be a positive int"),
    ({"value_bits": 3}, r"value_bits must be None or one of \(1, 2, 4, 8\)"),
    ({"value_bits": 16}, r"value_bits must be None or one of \(1, 2, 4, 8\)"),
    ({"value_bits": 2, "value_dtype": "bfloat16"}, "Pass value_bits=2 or value_dtype=bfloat16"),
    ({"wire": "ring"}, r"wire must be one of \('all_gather', 'all_reduce'\)"),
    ({"wire": "all_reduce", "value_bits": 1}, "pass density=1.0 and value_bits .got density=0.01"),
    ({"wire": "all_reduce", "density": 1.0}, "got density=1.0, value_bits=None"),
    ({"wire": "all_reduce", "density": {0: 1.0}, "value_bits": 1}, "got density=.0: 1.0."),
    ({"wire": "all_reduce", "density": 1.0, "value_bits": 1, "mean_bits": 3}, "mean_bits=3"),
    ({"density": 1.0, "value_bits": 1, "mean_bits": 2}, "mean_bits is for wire='all_reduce'"),
])
def test_bad_options_are_refused(options, message):
  with pytest.raises((ValueError, TypeError), match=message):
    exdyna_jax.chunked_topk(**{"density": 0.01, **options})
