"""The Pallas kernels of the passes over a partition, against NumPy and the loops.

On NVIDIA GPUs `_selection.count_in_range` and `_selection.select_in_range`
run as Pallas kernels (`_range_kernels`); here they are forced on the CPU,
where Pallas interprets them. They must give exactly what the loops give:
the probe counts and the largest magnitude of the range, the lowest ``C``
passing indices and the pass count, for ranges that start and end inside
blocks and programs, at the vector's end, empty, with NaN, and under
``vmap`` with a range per worker; and a whole ExDyna, MiCRO or steered
Top-k run must be the same bit for bit. The step lowers for CUDA with
three Triton kernels, and GPUs older than Ampere keep the loops.
"""

from __future__ import annotations

import functools
from unittest import mock

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import exdyna_jax
from exdyna_jax.core import _collectives
from exdyna_jax.selection import _range_kernels, _selection
from tests import harness
from tests.test_selection import numpy_select

N = 20_000
RANGES = [(0, N), (37, 9_001), (4_095, 4_130), (19_990, N), (5_000, 5_000), (1_024, 3_072)]
THRESHOLDS = np.asarray([0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5], np.float32)


# The methods whose passes run as the kernels.
KERNEL_METHODS = {"exdyna": exdyna_jax.exdyna, "micro": exdyna_jax.micro,
                  "steered_topk": functools.partial(exdyna_jax.topk, exact=False)}


@pytest.fixture(autouse=True)
def kernels_on_the_cpu(monkeypatch):
  monkeypatch.setattr(_range_kernels, "KERNEL_PLATFORMS", ("cpu",))


def gradient(seed, size=N, nan_fraction=0.01):
  rng = np.random.default_rng(seed)
  values = rng.standard_normal(size).astype(np.float32)
  values[rng.random(size) < nan_fraction] = np.nan
  return values


@pytest.mark.parametrize(("begin", "end"), RANGES)
@pytest.mark.parametrize("chunk", [2_048, 200_000])  # one block a program; three
def test_probe_counts_and_largest_magnitude_are_numpys(begin, end, chunk):
  values = gradient(begin + end)
  counts, largest = jax.jit(lambda v, b, e: _selection.count_in_range(
      v, b, e, jnp.asarray(THRESHOLDS), chunk=chunk))(values, np.int32(begin), np.int32(end))
  magnitudes = np.abs(values[begin:end])
  np.testing.assert_array_equal(np.asarray(counts), [np.sum(magnitudes >= t) for t in THRESHOLDS])
  assert float(largest) == (np.nanmax(magnitudes) if end > begin else 0.0)


@pytest.mark.parametrize(("begin", "end"), [r for r in RANGES if r[1] > r[0]])
@pytest.mark.parametrize(("fraction", "capacity"), [(0.002, 64), (0.05, 20), (0.6, 4_000),
                                                    (1.0, 1)])
def test_selected_indices_are_numpys(begin, end, fraction, capacity):
  """The lowest ``C`` passing indices, overflow and a full buffer included."""
  rng = np.random.default_rng(int(fraction * 100) + begin)
  values = np.where(rng.random(N) < fraction, 3.0, 0.5).astype(np.float32)
  values[rng.random(N) < 0.01] = np.nan
  selection = jax.jit(lambda v, b, e: _selection.select_in_range(
      v, jnp.float32(2.0), b, e, capacity=capacity, chunk=2_048, fallback_offset=5)
  )(values, np.int32(begin), np.int32(end))
  indices, passed = numpy_select(values, 2.0, begin, end, capacity, fallback_offset=5)
  np.testing.assert_array_equal(np.asarray(selection.indices), indices)
  assert int(selection.passed) == passed


def test_each_worker_reads_its_own_range_under_vmap():
  values = np.stack([gradient(1), -2 * gradient(2)])
  begins, ends = np.asarray([10, 12_000], np.int32), np.asarray([11_000, N], np.int32)

  def passes(v, b, e):
    counts = _selection.count_in_range(v, b, e, jnp.asarray(THRESHOLDS), chunk=2_048)
    return counts, _selection.select_in_range(v, jnp.float32(2.0), b, e, capacity=100,
                                              chunk=2_048, fallback_offset=0)

  (counts, largest), selection = jax.jit(jax.vmap(passes))(values, begins, ends)
  for worker, (begin, end) in enumerate(zip(begins, ends, strict=True)):
    magnitudes = np.abs(values[worker, begin:end])
    np.testing.assert_array_equal(np.asarray(counts[worker]),
                                  [np.sum(magnitudes >= t) for t in THRESHOLDS])
    assert float(largest[worker]) == np.nanmax(magnitudes)
    indices, passed = numpy_select(values[worker], 2.0, begin, end, 100, fallback_offset=0)
    np.testing.assert_array_equal(np.asarray(selection.indices[worker]), indices)
    assert int(selection.passed[worker]) == passed


def test_a_vector_shorter_than_a_block_keeps_the_loops():
  """The kernels read whole blocks in bounds; a shorter vector is read by the loops."""
  assert not _range_kernels.fits(_range_kernels.BLOCK - 1)
  values = gradient(3, size=500)
  counts, _ = _selection.count_in_range(values, jnp.int32(3), jnp.int32(400),
                                        jnp.asarray(THRESHOLDS), chunk=2_048)
  magnitudes = np.abs(values[3:400])
  np.testing.assert_array_equal(np.asarray(counts), [np.sum(magnitudes >= t) for t in THRESHOLDS])
  jaxpr = jax.make_jaxpr(lambda v: _selection.count_in_range(
      v, jnp.int32(3), jnp.int32(400), jnp.asarray(THRESHOLDS), chunk=2_048))(values)
  assert "pallas_call" not in str(jaxpr)


@pytest.mark.parametrize("runner", [harness.run_vmap, harness.run_shard_map],
                         ids=["vmap", "shard_map"])
@pytest.mark.parametrize("name", ["exdyna", "micro", "steered_topk"])
def test_a_run_with_the_kernels_is_the_run_with_the_loops(name, runner, monkeypatch):
  """Eight workers, ten steps of uneven gradients: every state and update the same."""
  params = {"w": jnp.zeros((96, 160)), "b": jnp.zeros((7_000,))}
  scale = np.concatenate([np.linspace(0.5, 4.0, 7_000), np.full(96 * 160, 0.1)])  # b, then w
  rng = np.random.default_rng(4)
  flat = (scale * rng.standard_normal((8, 10, scale.size))).astype(np.float32)
  grads = harness.unflatten_like(flat, params)
  tx = KERNEL_METHODS[name](density=0.01)
  with_kernels = runner(tx, params, grads)[:2]
  monkeypatch.setattr(_range_kernels, "KERNEL_PLATFORMS", ())
  chex.assert_trees_all_equal(runner(tx, params, grads)[:2], with_kernels)


@pytest.mark.parametrize("name", ["exdyna", "steered_topk"])
def test_the_step_lowers_for_nvidia_gpus_with_three_triton_kernels(name, monkeypatch):
  """Lowered for CUDA from this CPU machine, under ``shard_map`` with its check
  of what varies over the workers (which Pallas' interpreter cannot run): the
  probe count and the selection's two passes are Triton kernels. (The guard's
  host callback cannot be lowered for another platform than the machine's:
  left out here.)"""
  monkeypatch.setattr(_range_kernels, "KERNEL_PLATFORMS", ("cuda",))
  params = {"w": jnp.zeros((96, 160)), "b": jnp.zeros((7_000,))}
  grads = jax.tree.map(lambda p: jnp.ones((8, 2, *p.shape)), params)
  per_worker = harness._scan_steps(KERNEL_METHODS[name](density=0.01), params)

  def body(grads):
    return jax.tree.map(lambda x: x[None], per_worker(jax.tree.map(lambda g: g[0], grads)))

  step = jax.jit(jax.shard_map(body, mesh=harness.mesh_of(8), in_specs=jax.P(harness.AXIS),
                               out_specs=jax.P(harness.AXIS), check_vma=True))
  with mock.patch.object(_collectives, "on_host", lambda *args: jnp.int32(0)):
    text = step.trace(grads).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("__gpu$xla.gpu.triton") == 3


@pytest.mark.parametrize(("capability", "kernels"), [("7.5", False), ("8.0", True), ("9.0", True)])
def test_gpus_older_than_ampere_keep_the_loops(monkeypatch, capability, kernels):
  """Pallas' Triton backend needs compute capability 8.0: a T4 (7.5) keeps the loops."""
  class Device:
    compute_capability = capability

  monkeypatch.setattr(_range_kernels, "KERNEL_PLATFORMS", ("cuda",))
  monkeypatch.setattr(jax, "devices", lambda platform=None: [Device()] * 2)
  assert _range_kernels.kernel_platforms() == (("cuda",) if kernels else ())
