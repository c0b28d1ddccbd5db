"""The compiled-program reader behind the benchmarks' memory profile.

`benchmarks/hlo_memory.memory_traffic` estimates the bytes one step reads and writes from the
top-level ops of the compiled program; a fusion that reads an operand only
through slices or gathers reads what those return, not the whole operand.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import exdyna_jax
from benchmarks import cost, hlo_memory

N = 1 << 20
W = 1 << 16


def traffic(fn, *args) -> int:
  return hlo_memory.memory_traffic(jax.jit(fn).lower(*args).compile().as_text(), W)["bytes"]


def test_a_full_reduction_reads_the_vector():
  assert traffic(lambda x: jnp.sum(jnp.abs(x)), jnp.ones(N)) == 4 * N


def test_row_counts_of_a_slice_read_the_slice():
  """As `select_in_range` scans a chunk: the slice is fused into the reduction."""

  def window_row_counts(x, offset):
    window = jax.lax.dynamic_slice(x, (offset,), (W,))
    return jnp.sum((jnp.abs(window) >= 0.5).astype(jnp.int32).reshape(-1, 32), axis=1)

  counted = hlo_memory.memory_traffic(
      jax.jit(window_row_counts).lower(jnp.ones(N), jnp.int32(12345)).compile().as_text(),
      W // 32,
  )["bytes"]
  assert counted == 4 * W + 4 * (W // 32)  # the window in, one int32 per row out


def test_a_fused_gather_reads_what_it_gathers():
  def gathered_sum(x, indices):
    return jnp.sum(jnp.abs(x.reshape(-1)[indices]))

  indices = jnp.arange(2 * W, dtype=jnp.int32) * 7
  # The indices are read too (int32, 2W of them).
  assert traffic(gathered_sum, jnp.ones((1, N)), indices) == 4 * 2 * W + 4 * 2 * W


def test_the_profiles_no_guard_patch_takes_the_guard_out():
  """``patch=no_guard`` (the static profile's guard-free variant) still traces
  the library's step, now without the guard's conditionals, and the step
  still returns the mean gradient."""
  tx = exdyna_jax.dense(axis_name="data")
  grads = jnp.arange(8.0).reshape(2, 4)
  state = jax.vmap(lambda _: tx.init(jnp.zeros(4)), axis_name="data")(jnp.arange(2))

  def step(g, s):
    return tx.update(g, s)[0]

  with cost._patched("no_guard"):
    jaxpr = str(jax.make_jaxpr(jax.vmap(step, axis_name="data"))(grads, state))
    mean = jax.vmap(step, axis_name="data")(grads, state)
  assert "cond[" not in jaxpr
  assert jnp.allclose(mean, jnp.mean(grads, axis=0))
