"""Properties every registered method keeps for any gradient tree (hypothesis).

Random pytrees (1 to 4 leaves of rank 0 to 2, empty and size-1 leaves,
float32/bfloat16/float16), ``n`` from 1 to 8 simulated workers (vmap), and
densities from one element to half of them. Every example compiles a new
program, so the example counts are small; the draws still cover the corners
(``n = 1``, ``k = 1``, leaves of size 0 and 1) over a few runs.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import exdyna_jax
from tests import harness

DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
EPS = {jnp.dtype(d): float(jnp.finfo(d).eps) for d in DTYPES}
NUM_STEPS = 3
ERROR_FEEDBACK = ("cltk", "exdyna", "hard_threshold", "micro", "topk")
PARTITIONED = ("exdyna", "micro")


def minimum_elements(name: str, num_workers: int) -> int:
  if name == "exdyna":  # num_blocks = 4 n blocks of at least 32 elements
    return 32 * 4 * num_workers
  return max(2, num_workers)


@st.composite
def cases(draw, name: str):
  """``(n, leaves [(shape, dtype)], k, seed)`` for method ``name``."""
  num_workers = draw(st.integers(1, 8))
  dims = st.sampled_from([0, 1, 2, 3, 5, 17])
  shapes = draw(st.lists(st.lists(dims, max_size=2).map(tuple), min_size=0, max_size=3))
  needed = minimum_elements(name, num_workers)
  big = draw(st.integers(needed, needed + 400))
  shapes.insert(draw(st.integers(0, len(shapes))), (big,))
  dtypes = draw(st.lists(st.sampled_from(DTYPES), min_size=len(shapes), max_size=len(shapes)))
  num_elements = sum(math.prod(shape) for shape in shapes)
  k = draw(st.integers(1, num_elements // 2) | st.just(1))
  seed = draw(st.integers(0, 2**16))
  return num_workers, list(zip(shapes, dtypes, strict=True)), k, seed


def build(name, num_workers, density):
  if name == "dense":
    return exdyna_jax.dense()
  if name == "exdyna":
    return exdyna_jax.exdyna(density, num_blocks=4 * num_workers)
  return exdyna_jax.get_sparsifier(name, density=density)


def capacity_bound(name, num_workers, num_elements, k, density):
  """Most distinct indices one step may transmit."""
  if name in PARTITIONED:
    # The adaptive controller packs the gathered indices into ceil(1.1 k)
    # value slots before the psum (docs/algorithms.md).
    return math.ceil(1.1 * k)
  if name == "hard_threshold":
    return num_workers * max(1, min(math.ceil(2.0 * k), num_elements))
  if name == "cltk":
    return k
  if name == "spardl":
    return num_workers * max(1, math.floor(density * -(-num_elements // num_workers)))
  if name in ("topk",):
    return num_workers * k
  return num_elements


def flat(tree, lead=2):
  return np.concatenate(
      [np.asarray(leaf, np.float32).reshape(*leaf.shape[:lead], -1) for leaf in tree], axis=-1
  )


def check(name, num_workers, leaves, k, seed):
  num_elements = sum(math.prod(shape) for shape, _ in leaves)
  density = (k + 0.5) / num_elements  # floor(density * N) == k exactly
  params = [jnp.zeros(shape, dtype) for shape, dtype in leaves]
  rng = np.random.default_rng(seed)
  grads = [
      jnp.asarray(rng.standard_t(3, size=(num_workers, NUM_STEPS, *shape)), dtype)
      for shape, dtype in leaves
  ]
  updates, states, _ = harness.run_vmap(build(name, num_workers, density), params, grads)
  stats = jax.tree.map(np.asarray, exdyna_jax.get_stats(states))

  g, u = flat(grads), flat(updates)  # [n, T, N]
  eps = np.concatenate([np.full(math.prod(s), EPS[jnp.dtype(d)]) for s, d in leaves])
  assert u.dtype == np.float32 and u.shape == (num_workers, NUM_STEPS, num_elements)

  # One update on every worker; the stats are the same everywhere too.
  np.testing.assert_array_equal(u, np.broadcast_to(u[:1], u.shape))
  for field in stats:
    np.testing.assert_array_equal(field, np.broadcast_to(field[:1], field.shape))
  stats = jax.tree.map(lambda x: x[0], stats)  # [T, ...]
  u = u[0]

  np.testing.assert_array_equal(stats.step, np.arange(1, NUM_STEPS + 1))
  np.testing.assert_array_equal(stats.nonfinite, 0)
  np.testing.assert_array_equal(stats.skipped_steps, 0)
  assert np.isfinite(stats.threshold).all()
  if name == "dense":
    np.testing.assert_array_equal(stats.threshold, 0)
  else:
    assert (stats.threshold > 0).all(), stats.threshold

  # Partitions within bounds.
  sizes, starts = stats.partition_sizes, stats.partition_starts
  units = 4 * num_workers if name == "exdyna" else num_elements
  assert (sizes >= (1 if name in PARTITIONED else 0)).all()
  if name in PARTITIONED or name == "spardl":
    np.testing.assert_array_equal(sizes.sum(axis=-1), units)
  if name in PARTITIONED:
    np.testing.assert_array_equal(starts[:, 0], 0)
    np.testing.assert_array_equal(starts[:, 1:], np.cumsum(sizes, axis=-1)[:, :-1])
  elif name != "spardl":
    np.testing.assert_array_equal(starts, 0)
    np.testing.assert_array_equal(sizes, num_elements)

  # Capacity never exceeded; the stats agree with the update.
  nonzero = (u != 0).sum(axis=-1)
  assert (stats.transmitted <= capacity_bound(name, num_workers, num_elements, k, density)).all()
  assert (nonzero <= stats.transmitted).all()
  if name in PARTITIONED:
    np.testing.assert_array_equal(stats.selected - stats.overflow, stats.transmitted)
    np.testing.assert_array_equal(stats.workloads.sum(axis=-1), stats.selected)

  if name == "dense":
    tolerance = 1e-5 + num_workers * np.abs(u).max() * eps.max()
    np.testing.assert_allclose(num_workers * u, g.sum(axis=0), rtol=0, atol=tolerance)
    return
  residuals = np.asarray(states.residual)  # [n, T, N] float32
  assert residuals.dtype == np.float32
  previous = np.concatenate([np.zeros_like(residuals[:, :1]), residuals[:, :-1]], axis=1)
  accumulated = g + previous
  # Conservation: nothing lost but the rounding of the update to the leaf dtype.
  kept = residuals.sum(axis=0) + num_workers * u
  tolerance = num_workers * np.abs(u) * eps + 1e-5 * (1 + np.abs(accumulated).sum(axis=0))
  assert (np.abs(kept - accumulated.sum(axis=0)) <= tolerance).all()
  if name in ERROR_FEEDBACK:
    # Every transmitted index is cleared on every worker, and nothing else is
    # (a bfloat16/float16 leaf keeps what rounding the update to it lost).
    rounding = np.where(eps > EPS[jnp.dtype(jnp.float32)], eps * np.abs(u), 0.0)
    cleared = (np.abs(residuals) <= rounding).all(axis=0) & (accumulated != 0).any(axis=0)
    np.testing.assert_array_equal(cleared.sum(axis=-1), stats.transmitted)
    assert not (u != 0)[~cleared].any()
  else:  # SparDL: one value per selected index, all of them nonzero here
    np.testing.assert_array_equal(nonzero, stats.transmitted)


PROPERTY_SETTINGS = settings(
    max_examples=3,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.mark.parametrize("name", exdyna_jax.available_sparsifiers())
def test_invariants_hold_for_random_trees_workers_and_densities(name):
  @PROPERTY_SETTINGS
  @given(case=cases(name))
  def run(case):
    check(name, *case)

  run()
