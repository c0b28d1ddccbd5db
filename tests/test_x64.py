"""Under ``jax_enable_x64`` every method trains float32 and float64 parameters.

With x64 on, a float32 model trains bit for bit as it does with x64 off; a
float64 model gets float64 updates, equal to the float32 run's within float32
rounding (the sparsifier accumulates, selects and exchanges in float32
whatever the leaves: `docs/usage.md`); and the optimizer state holds the
same int32 and float32 arrays either way, so a checkpoint moves between the
two settings. The flag is set with ``jax.enable_x64`` around each run, as a
user's script would set it globally.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import exdyna_jax
from tests import harness

N_WORKERS, STEPS = 4, 3
METHODS = exdyna_jax.available_sparsifiers()


def options(method):
  return {} if method == "dense" else {"density": 0.02}


def train(method, dtype):
  """Three steps of ``chain(method, sgd)`` on 4 simulated workers: (params, final state)."""
  tx = optax.chain(exdyna_jax.get_sparsifier(method, **options(method)), optax.sgd(0.5))
  params = {"w": jnp.zeros((32, 40), dtype), "b": jnp.zeros((40,), dtype)}
  rng = np.random.default_rng(0)
  grads = {
      "w": rng.standard_normal((N_WORKERS, STEPS, 32, 40)).astype(dtype),
      "b": rng.standard_normal((N_WORKERS, STEPS, 40)).astype(dtype),
  }

  def per_worker(grads):
    def step(carry, grads_t):
      params, state = carry
      updates, state = tx.update(grads_t, state, params)
      return (optax.apply_updates(params, updates), state), None

    (final, state), _ = jax.lax.scan(step, (params, tx.init(params)), grads)
    return final, state

  return jax.jit(jax.vmap(per_worker, axis_name=harness.AXIS, axis_size=N_WORKERS))(grads)


@pytest.mark.parametrize("method", METHODS)
def test_every_method_trains_float32_and_float64_under_x64(method):
  reference_params, reference_state = train(method, np.float32)
  with jax.enable_x64(True):
    params32, state32 = train(method, np.float32)
    params64, state64 = train(method, np.float64)

  jax.tree.map(np.testing.assert_array_equal, params32, reference_params)
  jax.tree.map(np.testing.assert_array_equal, state32, reference_state)
  assert {leaf.dtype for leaf in jax.tree.leaves(params64)} == {np.dtype(np.float64)}
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
               params64, reference_params)
  same_dtypes = jax.tree.map(lambda a, b: a.dtype == b.dtype, state64, reference_state)
  assert all(jax.tree.leaves(same_dtypes))


def test_data_parallel_step_under_x64():
  mesh = harness.mesh_of(8)
  tx = optax.chain(exdyna_jax.exdyna(0.05), optax.sgd(0.1))

  def loss(params, batch):
    inputs, targets = batch
    return jnp.mean((inputs @ params["w"] - targets) ** 2)

  rng = np.random.default_rng(1)
  with jax.enable_x64(True):
    params = {"w": jnp.zeros((16, 4), jnp.float64)}
    batch = (rng.standard_normal((64, 16)), rng.standard_normal((64, 4)))
    dp = exdyna_jax.data_parallel(tx, mesh)
    state = dp.init(params)

    @dp.step
    def step(params, state, batch):
      grads = jax.grad(loss)(params, batch)
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state

    before = float(loss(params, batch))
    for _ in range(20):
      params, state = step(params, state, batch)
    assert params["w"].dtype == jnp.float64
    assert float(loss(params, batch)) < 0.9 * before
    assert int(dp.stats(state).step) == 20
