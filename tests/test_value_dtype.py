"""``value_dtype``: the exchanged values summed in bfloat16 or float16.

The specification (NumPy model below): each worker sends ``v / n`` rounded
to ``value_dtype`` (clipped to its range over ``n``) at every exchanged
index; the update there is the sum of what the workers sent; each worker
keeps ``v - n * sent`` in its residual, so its rounding is not lost. The
indices are those of the float32 exchange; the value bytes halve.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import exdyna_jax
from tests import harness

N, NUM_WORKERS = 4096, 4
METHODS = ("exdyna", "micro", "topk", "cltk", "hard_threshold")


def make(name, value_dtype, density=0.02):
  return exdyna_jax.get_sparsifier(name, density=density, value_dtype=value_dtype)


def one_step(tx, grads):
  """``(update [N], residual [n, N], stats)`` of one step from init, per worker."""
  params = jnp.zeros(grads.shape[1])

  def per_worker(g):
    update, state = tx.update(g, tx.init(params), params)
    return update, state.residual, exdyna_jax.get_stats(state)

  mapped = jax.vmap(per_worker, axis_name=harness.AXIS, axis_size=grads.shape[0])
  update, residual, stats = jax.jit(mapped)(grads)
  return np.asarray(update[0]), np.asarray(residual), stats


@pytest.mark.parametrize("value_dtype", [ml_dtypes.bfloat16, np.float16])
@pytest.mark.parametrize("name", METHODS)
def test_each_worker_keeps_what_its_rounding_loses(name, value_dtype):
  rng = np.random.default_rng(0)
  grads = (rng.standard_t(3, size=(NUM_WORKERS, N)) * 1e-2).astype(np.float32)
  grads[0, 5] = 1e6  # past float16's range once divided by n: clipped, the rest kept
  update, residual, _ = one_step(make(name, jnp.dtype(value_dtype)), grads)
  exact_update, _, _ = one_step(make(name, jnp.float32), grads)
  sent_at = np.flatnonzero(exact_update)  # the same indices as in float32
  np.testing.assert_array_equal(np.flatnonzero(update), sent_at)

  limit = float(ml_dtypes.finfo(value_dtype).max) / NUM_WORKERS
  sent = np.clip(grads[:, sent_at] / NUM_WORKERS, -limit, limit).astype(value_dtype)
  sent = sent.astype(np.float32)  # [n, M]: what each worker put on the wire
  np.testing.assert_allclose(residual[:, sent_at], grads[:, sent_at] - NUM_WORKERS * sent,
                             rtol=1e-6, atol=1e-9)
  # The sum is formed in value_dtype: equal to the exact sum of what was sent up to
  # one rounding per worker.
  total = sent.sum(0)
  ulp = np.abs(sent).sum(0) * float(ml_dtypes.finfo(value_dtype).eps) * NUM_WORKERS
  assert (np.abs(update[sent_at] - total) <= ulp + 1e-12).all()
  assert np.isfinite(update).all()
  unsent = np.setdiff1d(np.arange(N), sent_at)
  np.testing.assert_array_equal(residual[:, unsent], grads[:, unsent])


def test_one_worker_conserves_everything():
  """With one worker there is no sum to round: what is sent plus kept is what came in."""
  rng = np.random.default_rng(1)
  grads = rng.standard_t(3, size=(1, 10, N)).astype(np.float32)
  tx = make("exdyna", "bfloat16")
  params = jnp.zeros(N)

  def run(g):
    def step(state, g):
      update, state = tx.update(g, state, params)
      return state, update

    return jax.lax.scan(step, tx.init(params), g)

  state, updates = jax.jit(jax.vmap(run, axis_name=harness.AXIS, axis_size=1))(grads)
  kept_plus_sent = np.asarray(state.residual[0], np.float64) + np.asarray(updates[0]).sum(0)
  np.testing.assert_allclose(kept_plus_sent, grads[0].astype(np.float64).sum(0), atol=2e-5)


def test_bf16_values_cut_the_bytes_and_the_all_reduce_is_bf16():
  """At a benchmark-like size (N = 2^20, n = 8, d = 0.001) the bytes fall to at most 0.8."""
  grads = np.random.default_rng(2).normal(size=(8, 2**20)).astype(np.float32)
  counted = {}
  for dtype in ("float32", "bfloat16"):
    counted[dtype] = int(one_step(make("exdyna", dtype, 0.001), grads)[2].bytes_sent[0])
  assert counted["bfloat16"] <= 0.8 * counted["float32"], counted

  tx = make("exdyna", "bfloat16", 0.001)
  dp = exdyna_jax.data_parallel(tx, harness.mesh_of(8))
  params = jnp.zeros(2**20)

  @dp.step
  def step(params, opt_state, grads):
    updates, opt_state = tx.update(grads[0], opt_state, params)
    return params + updates, opt_state

  # The program we emit sums bfloat16 (XLA's CPU backend then widens it to float32 for
  # the reduction; GPU collectives keep it).
  lowered = step.lower(params, dp.init(params), grads).as_text()
  summed = re.findall(r'"stablehlo.all_reduce".*?\}\) : \(tensor<(\w+)>\)', lowered, re.S)
  assert [t for t in summed if t.endswith("xbf16")], summed


@pytest.mark.parametrize("value_dtype", ["int8", "float64", "fp8", None])
def test_other_value_dtypes_are_refused(value_dtype):
  with pytest.raises(ValueError, match="value_dtype must be one of float32, bfloat16, float16"):
    exdyna_jax.exdyna(0.01, value_dtype=value_dtype)


@pytest.mark.parametrize("name", harness.SPARSIFYING)
def test_a_float16_leaf_past_its_range_is_clipped_and_the_rest_kept(name):
  """Accumulated values past float16's 65,504: the update is clipped to it, never inf,
  and what it could not carry stays owed (the workers' mean residual)."""
  workers, steps, size = 8, 3, 4096
  rng = np.random.default_rng(0)
  grads = rng.normal(size=(workers, steps, size))
  grads[:, :, :400] = 60_000.0  # every worker, every step: more than k of them
  grads = grads.astype(np.float16)
  tx = exdyna_jax.get_sparsifier(name, density=0.05)
  updates, states, _ = harness.run_vmap(tx, jnp.zeros(size, jnp.float16), grads)
  updates = np.asarray(updates, np.float64)
  residual = np.asarray(optax.tree.get(states, "residual"), np.float64)[:, -1]
  assert np.isfinite(updates).all() and np.isfinite(residual).all()
  assert np.abs(updates).max() <= 65_504
  assert int(np.asarray(exdyna_jax.get_stats(states).nonfinite).sum()) == 0
  owed = grads.astype(np.float64).mean(axis=0).sum(axis=0)
  np.testing.assert_allclose(updates[0].sum(axis=0) + residual.mean(axis=0), owed, rtol=1e-6,
                             atol=1e-2)
