"""``docs/package_map.md``, "Adding a method", followed to the letter.

A throwaway method written the way the recipe says (a step on the shell, one
registry entry) must work everywhere a registered method does: by name, in
``data_parallel``'s step with its stats, with a density schedule, under
``hierarchical``, and through ``resize_workers``, without touching any other
module. Its updates and residuals are checked against a NumPy model.
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import exdyna_jax
from exdyna_jax.core import _collectives, _stats
from exdyna_jax.exchange import _exchange
from exdyna_jax.methods import _registry
from exdyna_jax.shell import _feedback
from tests import harness

N, NUM_WORKERS, STEPS = 1000, 8, 5


def round_robin(density, *, axis_name: str = "data", value_dtype=jnp.float32):
  """Sends the ``k`` elements from ``step * k`` on (modulo ``N``), the same on every worker."""

  def sparsify(accumulated, stats, num_workers, k):
    num_elements = accumulated.shape[0]
    window = (stats.step * k + jnp.arange(k, dtype=jnp.int32)) % num_elements
    sparse = _exchange.aggregate_at(accumulated, window, axis_name, jnp.dtype(value_dtype))
    count = jnp.int32(k)
    return sparse, _stats.unpartitioned_stats(
        stats, threshold=jnp.float32(0.0), selected=count, transmitted=count,
        overflow=jnp.zeros((), jnp.int32), workloads=jnp.full((num_workers,), k, jnp.int32),
        num_elements=num_elements, target=k,
        bytes_sent=_collectives.ring_all_reduce_bytes(
            num_workers, k * jnp.dtype(value_dtype).itemsize),
    )

  return _feedback.fixed_budget_transform(density, axis_name=axis_name, sparsify=sparsify)


@pytest.fixture
def registered(monkeypatch):
  monkeypatch.setattr(_registry, "SPARSIFIERS",
                      types.MappingProxyType({**_registry.SPARSIFIERS, "round_robin": round_robin}))


def model(grads, densities):
  """NumPy: the mean at the ``k_t`` elements from ``t * k_t`` on: ``(updates, residuals)``."""
  residual = np.zeros_like(grads[:, 0], np.float64)
  updates = []
  for t, density in enumerate(densities):
    accumulated = residual + grads[:, t]
    k = int(np.floor(density * N))
    window = (np.arange(k) + t * k) % N  # the step counter times this step's k
    update = np.zeros(N)
    update[window] = accumulated[:, window].mean(0)
    residual = accumulated.copy()
    residual[:, window] = 0.0
    updates.append(update)
  return np.stack(updates), residual


@pytest.mark.usefixtures("registered")
def test_a_registered_method_trains_in_data_parallel_with_a_schedule():
  assert "round_robin" in exdyna_jax.available_sparsifiers()
  schedule = {0: 0.01, 3: 0.02}
  tx = exdyna_jax.get_sparsifier("Round-Robin", density=schedule)
  dp = exdyna_jax.data_parallel(tx, harness.mesh_of(NUM_WORKERS))
  grads = np.random.default_rng(0).normal(size=(NUM_WORKERS, STEPS, N)).astype(np.float32)

  @dp.step
  def step(params, opt_state, grads):
    updates, opt_state = tx.update(grads[0], opt_state, params)
    return params + updates, opt_state

  params, opt_state, updates = jnp.zeros(N), dp.init(jnp.zeros(N)), []
  for t in range(STEPS):
    before = np.asarray(params)  # the step donates params
    params, opt_state = step(params, opt_state, grads[:, t])
    updates.append(np.asarray(params) - before)
  densities = [0.01 if t < 3 else 0.02 for t in range(STEPS)]
  want_updates, want_residual = model(grads.astype(np.float64), densities)
  np.testing.assert_allclose(np.stack(updates), want_updates, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(opt_state.residual, want_residual, rtol=1e-5, atol=1e-6)
  stats = dp.stats(opt_state)
  assert int(stats.target) == 20
  totals = exdyna_jax.read_totals(stats)
  assert (totals["steps"], totals["target"], totals["transmitted"]) == (STEPS, 70, 70)

  resized = exdyna_jax.resize_workers(tx, opt_state, params, 4)
  assert jax.tree.leaves(resized)[0].shape[0] == 4
  assert int(exdyna_jax.get_stats(resized).num_workers[0]) == 4


@pytest.mark.usefixtures("registered")
def test_a_registered_method_runs_across_nodes():
  """Under ``hierarchical`` over 2 nodes of 2 devices: the method on the node means."""
  grads = np.random.default_rng(1).normal(size=(2, 2, N)).astype(np.float32)
  params = jnp.zeros(N)
  tx = exdyna_jax.hierarchical(
      exdyna_jax.get_sparsifier("round_robin", density=0.01, axis_name="node"),
      fast_axis="local", fast_reduce="psum")

  def device(g):
    return tx.update(g, tx.init(params), params)[0]

  nodes = jax.vmap(jax.vmap(device, axis_name="local"), axis_name="node")
  updates = np.asarray(nodes(grads))
  want, _ = model(grads.mean(1)[:, None].astype(np.float64), [0.01])
  np.testing.assert_allclose(updates[1, 0], want[0], rtol=1e-6, atol=1e-7)


@pytest.mark.usefixtures("registered")
@pytest.mark.parametrize("density, levels", [(0.01, 1), ({0: 0.01, 3: 0.02}, 2)])
def test_an_update_runs_the_methods_python_once_a_level(monkeypatch, density, levels):
  """The guard's switch and a schedule's need each step's output shapes first:
  each is recorded once and its program replayed, so the method's own Python
  runs once a density level per trace."""
  calls = []
  real_aggregate = _exchange.aggregate_at
  monkeypatch.setattr(_exchange, "aggregate_at",
                      lambda *args: calls.append(1) or real_aggregate(*args))
  tx = exdyna_jax.get_sparsifier("round_robin", density=density)
  params = jnp.zeros(N)
  grads = np.ones((NUM_WORKERS, N), np.float32)
  state = jax.vmap(tx.init, in_axes=None, axis_name="data", axis_size=NUM_WORKERS)(params)
  jax.jit(jax.vmap(lambda g, s: tx.update(g, s, params), axis_name="data")).trace(grads, state)
  assert len(calls) == levels
