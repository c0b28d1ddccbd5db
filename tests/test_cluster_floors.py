"""The emulated cluster's floor rows (`benchmarks/cluster_worker.FLOORS`).

``rounds_only`` is compute plus the collectives of ExDyna's compiled step
and nothing else, ``shell_only`` the error-feedback shell around them; each
is a floor only if its compiled program runs those collectives as given
(XLA neither drops nor merges them) and its update is what it claims: the
worker's own gradient, or the mean of ``a = g + m`` at the indices sent.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import exdyna_jax
from benchmarks import cluster_worker
from exdyna_jax import hlo
from exdyna_jax.demo.cluster_worker import AXIS

WORKERS = 4
REPLAYED = [{"kind": "all-reduce", "result_bytes": 8},
            {"kind": "all-gather", "result_bytes": 4 * 4 * 1000},
            {"kind": "all-gather", "result_bytes": 4 * 4 * 37}]


def worker_mesh() -> jax.sharding.Mesh:
  return jax.make_mesh((WORKERS,), (AXIS,), devices=jax.devices()[:WORKERS])


def kinds_and_sizes(ops: list) -> list[tuple[str, int]]:
  return [(op["kind"], op["result_bytes"]) if isinstance(op, dict) else (op.kind, op.result_bytes)
          for op in ops]


def test_rounds_only_runs_the_collectives_given_and_passes_the_gradient_through():
  mesh = worker_mesh()
  tx = cluster_worker.rounds_only(REPLAYED)
  grads = {"w": jax.random.normal(jax.random.key(0), (WORKERS, 64, 3)),
           "b": jax.random.normal(jax.random.key(1), (WORKERS, 3))}

  def per_worker(grads):
    updates, _ = tx.update(jax.tree.map(lambda g: g[0], grads), tx.init(grads))
    return jax.tree.map(lambda u: u[None], updates)

  step = jax.jit(jax.shard_map(per_worker, mesh=mesh, in_specs=jax.P(AXIS),
                               out_specs=jax.P(AXIS), check_vma=False))
  grads = jax.device_put(grads, jax.sharding.NamedSharding(mesh, jax.P(AXIS)))
  updates = step(grads)
  jax.tree.map(np.testing.assert_array_equal, updates, grads)
  compiled = hlo.collectives(step.lower(grads).compile().as_text(), WORKERS)
  assert kinds_and_sizes(compiled) == kinds_and_sizes(REPLAYED)


def test_rounds_only_refuses_a_collective_it_cannot_replay():
  tx = cluster_worker.rounds_only([{"kind": "collective-permute", "result_bytes": 64}])
  with pytest.raises(ValueError, match="no replay of a collective-permute"):
    jax.vmap(lambda g: tx.update(g, tx.init(g))[0], axis_name=AXIS)(jnp.ones((WORKERS, 8)))


def test_shell_only_sends_the_mean_at_free_indices_through_the_shell():
  """The update: the mean of ``a = g + m`` at the free indices; the residual: the rest."""
  num_elements, slots = 4000, 25
  replayed = [*REPLAYED[:2], {"kind": "all-gather", "result_bytes": 4 * WORKERS * slots}]
  tx = cluster_worker.shell_only(replayed, density=0.01)
  grads = jax.random.normal(jax.random.key(2), (2, WORKERS, num_elements))

  def two_steps(first, second):
    state = tx.init(jnp.zeros(num_elements))
    update, state = tx.update(first, state)
    return update, tx.update(second, state)

  (first, (second, state)) = jax.vmap(two_steps, axis_name=AXIS)(grads[0], grads[1])
  sent = np.arange(slots) * (num_elements // slots)
  expected = np.zeros(num_elements)
  expected[sent] = np.asarray(grads[0]).mean(0)[sent]
  np.testing.assert_allclose(first[0], expected, rtol=1e-6)
  expected[sent] = np.asarray(grads[1]).mean(0)[sent]  # the same indices: their residual is 0
  np.testing.assert_allclose(second[1], expected, rtol=1e-6)
  residual = np.array(grads[0] + grads[1])
  residual[:, sent] = 0
  np.testing.assert_allclose(state.residual, residual, rtol=1e-6)


def test_the_shell_runs_the_collectives_given():
  """Under shard_map, as on the cluster: the guard's psum, the replayed gather, the values."""
  mesh = worker_mesh()
  tx = cluster_worker.shell_only(REPLAYED, density=0.01)
  dp = exdyna_jax.data_parallel(tx, mesh, axis_name=AXIS)
  params = jnp.zeros(4000)

  @dp.step
  def step(params, opt_state, grads):
    updates, opt_state = tx.update(grads[0], opt_state, params)
    return params + updates, opt_state

  grads = jax.device_put(jnp.ones((WORKERS, 4000)),
                         jax.sharding.NamedSharding(mesh, jax.P(AXIS)))
  compiled = hlo.collectives(
      step.lower(params, dp.init(params), grads).compile().as_text(), WORKERS)
  assert kinds_and_sizes(compiled) == kinds_and_sizes(REPLAYED)
