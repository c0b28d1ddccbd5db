"""Every sparsifier by name: builds, runs one step in a chain, reports its stats."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import exdyna_jax
from tests.harness import AXIS

NUM_WORKERS = 2
PARAMS = {"b": jnp.zeros((16,)), "w": jnp.zeros((32, 32))}  # 1040 elements
OPTIONS = {"exdyna": {"density": 0.05, "num_blocks": 8}, "dense": {}}
DEFAULT_OPTIONS = {"density": 0.05}
BUILT_IN = ("cltk", "dense", "exdyna", "hard_threshold", "micro", "topk")


def test_built_in_names_are_available():
  names = exdyna_jax.available_sparsifiers()
  assert set(BUILT_IN) <= set(names)
  assert list(names) == sorted(names)


@pytest.mark.parametrize("name", exdyna_jax.available_sparsifiers())
def test_every_name_builds_and_runs_one_step(name):
  tx = optax.chain(
      exdyna_jax.get_sparsifier(name, **OPTIONS.get(name, DEFAULT_OPTIONS)), optax.sgd(0.1)
  )

  def per_worker(grads):
    state = tx.init(PARAMS)
    updates, state = tx.update(grads, state, PARAMS)
    return updates, optax.tree.get(state, "stats")

  grads = jax.tree.map(
      lambda p: jax.random.normal(jax.random.key(1), (NUM_WORKERS, *p.shape)), PARAMS
  )
  run = jax.jit(jax.vmap(per_worker, axis_name=AXIS, axis_size=NUM_WORKERS))
  updates, stats = run(grads)
  assert isinstance(stats, exdyna_jax.SparsifierStats)
  np.testing.assert_array_equal(stats.step, 1)
  assert np.all(np.asarray(stats.transmitted) > 0)
  leaves = [np.asarray(leaf) for leaf in jax.tree.leaves(updates)]
  for leaf in leaves:
    np.testing.assert_array_equal(leaf[0], leaf[1])  # one update for every worker
  assert any(np.any(leaf != 0) for leaf in leaves)


@pytest.mark.parametrize(
    ("spelling", "name"),
    [("Hard-Threshold", "hard_threshold"), ("hardthreshold", "hard_threshold"),
     ("top-k", "topk"), ("Top_K", "topk"), ("EXDYNA", "exdyna"), ("cl-tk", "cltk")],
)
def test_names_ignore_case_dashes_and_underscores(monkeypatch, spelling, name):
  monkeypatch.setattr(exdyna_jax.methods._registry, "SPARSIFIERS", {
      known: lambda known=known, **options: (known, options)
      for known in exdyna_jax.available_sparsifiers()})
  assert exdyna_jax.get_sparsifier(spelling, density=0.1) == (name, {"density": 0.1})


def test_unknown_name_lists_valid_names():
  with pytest.raises(ValueError, match="Unknown sparsifier 'powersgd'") as error:
    exdyna_jax.get_sparsifier("powersgd", density=0.1)
  for name in exdyna_jax.available_sparsifiers():
    assert name in str(error.value)


def test_options_reach_the_factory():
  with pytest.raises(TypeError, match="num_blocks"):
    exdyna_jax.get_sparsifier("micro", density=0.1, num_blocks=8)
  with pytest.raises(ValueError, match="density must be in"):
    exdyna_jax.get_sparsifier("topk", density=2.0)
