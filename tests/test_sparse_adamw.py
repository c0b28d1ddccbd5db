"""`sparse_adamw` and `scale_by_local_rms` against an independent NumPy model."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import exdyna_jax
from tests.harness import run_shard_map, run_vmap, unflatten_like
from tests.models import peers_model

NUM_WORKERS, NUM_STEPS, DENSITY = 4, 9, 0.05
SHAPES = {"b": (40,), "w": (16, 12)}  # N = 232
PARAMS = {name: jnp.full(shape, 0.25, jnp.float32) for name, shape in SHAPES.items()}
NUM_ELEMENTS = sum(math.prod(shape) for shape in SHAPES.values())
B2, EPS, LR, WEIGHT_DECAY = 0.99, 0.05, 0.01, 0.1  # eps: no ties in |g / (|g| + eps)| at step 1


def gradients() -> np.ndarray:
  rng = np.random.default_rng(0)
  scale = np.exp(np.linspace(-2, 1, NUM_ELEMENTS))
  return (rng.standard_t(3, (NUM_WORKERS, NUM_STEPS, NUM_ELEMENTS)) * scale).astype(np.float32)


def local_rms_model(grads: np.ndarray) -> np.ndarray:
  """``[n, T, N]``: each worker's gradient over the root of its own bias-corrected ``v``."""
  nu = np.zeros(grads[:, 0].shape, np.float32)
  out = []
  for t in range(grads.shape[1]):
    nu = np.float32(B2) * nu + np.float32(1 - B2) * grads[:, t] ** 2
    corrected = nu / np.float32(1 - B2 ** (t + 1))
    out.append(grads[:, t] / (np.sqrt(corrected) + np.float32(EPS)))
  return np.stack(out, 1)


def flat(tree) -> np.ndarray:
  leaves = [np.asarray(leaf) for leaf in jax.tree.leaves(tree)]
  return np.concatenate([leaf.reshape(*leaf.shape[:2], -1) for leaf in leaves], axis=-1)


@pytest.mark.parametrize("run", [run_vmap, run_shard_map])
def test_each_worker_preconditions_its_own_gradient_and_the_sparsifier_exchanges_that(run):
  grads = gradients()
  tx = exdyna_jax.sparse_adamw(exdyna_jax.topk(DENSITY), LR, b2=B2, eps=EPS,
                               weight_decay=WEIGHT_DECAY)
  updates, _, final = run(tx, PARAMS, unflatten_like(grads, PARAMS))
  exchanged = peers_model.topk(local_rms_model(grads), DENSITY)
  initial = np.full(NUM_ELEMENTS, 0.25, np.float32)
  expected = -LR * (exchanged.updates + WEIGHT_DECAY * initial)  # [T, N]: params held fixed
  for w in range(NUM_WORKERS):
    np.testing.assert_allclose(flat(updates)[w], expected, rtol=2e-5, atol=1e-7)
  np.testing.assert_allclose(np.asarray(optax.tree.get(final, "residual")),
                             exchanged.residuals[:, -1], rtol=2e-5, atol=1e-5)


def test_local_rms_keeps_each_workers_own_second_moment():
  grads = gradients()
  tx = exdyna_jax.scale_by_local_rms(B2, EPS)
  out = jax.vmap(lambda g: jax.lax.scan(
      lambda s, g: tx.update(g, s)[::-1], tx.init(PARAMS), g)[1])(unflatten_like(grads, PARAMS))
  np.testing.assert_allclose(flat(out), local_rms_model(grads), rtol=2e-6)


def test_a_bfloat16_gradient_comes_back_bfloat16():
  tx = exdyna_jax.scale_by_local_rms()
  params = jnp.zeros(8, jnp.bfloat16)
  updates, state = tx.update(jnp.ones(8, jnp.bfloat16), tx.init(params))
  assert updates.dtype == jnp.bfloat16 and state.nu.dtype == jnp.float32


def test_a_sparsifier_that_is_not_one_of_the_methods_is_refused_at_init():
  tx = exdyna_jax.sparse_adamw(optax.sgd(0.1), 1e-3)  # would leave every worker alone
  with pytest.raises(TypeError, match=r"sparse_adamw's sparsifier is .*train alone"):
    jax.vmap(tx.init, in_axes=None, axis_name="data", axis_size=4)(jnp.zeros(64))
