"""The per-worker update programs `benchmarks.gpu` times: 8 workers under ``vmap``.

``program`` builds one worker's step of a method of `benchmarks.gpu.METHODS`
(the library's, or the two written out here: ``floor`` and ``topk_ef``);
``vmapped_update`` maps it over the 8 workers and jits it, the state donated.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import exdyna_jax
from benchmarks._gpu_timing import AXIS, WORKERS, method_of

CHUNKED_VALUE_BITS = 2  # chunked_topk's compact wire, as local steps send it


def sparsifier(name, density):
  if method_of(name) == "exdyna":
    return exdyna_jax.exdyna(density, axis_name=AXIS)
  if name == "exdyna_reference":
    return exdyna_jax.exdyna(density, axis_name=AXIS, controller="reference")
  if name == "topk_union":
    return exdyna_jax.topk(density / WORKERS, exact=False, axis_name=AXIS)
  if name == "chunked_topk":
    return exdyna_jax.chunked_topk(density, value_bits=CHUNKED_VALUE_BITS,
                                   axis_name=AXIS)
  return exdyna_jax.micro(density, axis_name=AXIS)


def program(name, num_elements, density):
  """``(init(params) -> state, step(state, grads) -> (state, update))``, per worker."""
  params = jnp.zeros((num_elements,), jnp.float32)
  if name == "floor":
    def floor_step(residual, grads):
      accumulated = grads + residual
      # New residual and dense update; two different values, two buffers
      # written (equal ones would be computed once and copied: 20 N bytes).
      return accumulated * 0.5, accumulated * 0.25
    return lambda: jnp.zeros_like(params), floor_step
  if name == "topk_ef":
    k = int(density * num_elements)

    def topk_step(residual, grads):
      accumulated = grads + residual
      _, indices = jax.lax.top_k(jnp.abs(accumulated), k)
      values = jax.lax.psum(accumulated[indices], AXIS) / WORKERS
      update = jnp.zeros_like(accumulated).at[indices].set(values)
      return accumulated.at[indices].set(0.0), update
    return lambda: jnp.zeros_like(params), topk_step
  tx = sparsifier(name, density)

  def step(state, grads):
    update, state = tx.update(grads, state, params)
    return state, update
  return lambda: tx.init(params), step


def vmapped_update(name, num_elements, density):
  """``(state, run)``: the 8 workers' state and the jitted step ``run(state, grads)``."""
  init, step = program(name, num_elements, density)
  run = jax.jit(jax.vmap(step, axis_name=AXIS, axis_size=WORKERS), donate_argnums=0)
  state = jax.jit(jax.vmap(lambda _: init(), axis_name=AXIS, axis_size=WORKERS))(
      jnp.arange(WORKERS)
  )
  return state, run
