"""The residual is updated in place: a donated training step copies no N-vector
(but through a density schedule's switch).

The error-feedback shell forms ``a = g + m`` in the residual's own buffer and
clears the transmitted indices with a scatter after the step (whose result
is only the sparse pairs), so when the caller donates the state,
XLA needs no copy of the residual. This holds for the library's calling
conventions, where each device's residual buffer is ``[1, N]``: ``jax.pmap``,
and ``jax.shard_map`` with a leading worker axis on the state (as
`exdyna_jax.data_parallel` does).
"""

from __future__ import annotations

import itertools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import exdyna_jax
from exdyna_jax.shell import _feedback
from tests import harness

NUM_WORKERS = 8
SHAPES = {"w": (512, 64), "b": (64,)}
NUM_ELEMENTS = 512 * 64 + 64
ERROR_FEEDBACK = harness.SPARSIFYING


def make_tx(name: str, density=0.01) -> optax.GradientTransformation:
  return optax.chain(
      exdyna_jax.get_sparsifier(name, density=density, axis_name="data"), optax.sgd(0.1)
  )


def params() -> dict[str, jax.Array]:
  return {key: jnp.zeros(shape) for key, shape in SHAPES.items()}


def compiled_pmap_step(name: str, density=0.01) -> str:
  tx = make_tx(name, density)

  def train_step(params, opt_state, grads):
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  replicated = jax.tree.map(lambda x: jnp.broadcast_to(x, (NUM_WORKERS, *x.shape)), params())
  opt_state = jax.pmap(tx.init, axis_name="data")(replicated)
  step = jax.pmap(train_step, axis_name="data", donate_argnums=(0, 1))
  return step.lower(replicated, opt_state, replicated).compile().as_text()


def compiled_data_parallel_step(name: str, density=0.01) -> str:
  """The pjit-style helper: state leaves carry a leading worker axis, squeezed per device."""
  mesh = jax.make_mesh((NUM_WORKERS,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  parallel = exdyna_jax.data_parallel(make_tx(name, density), mesh)

  def train_step(params, opt_state, worker_grads):
    updates, opt_state = parallel.update(worker_grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  opt_state = parallel.init(params())
  worker_grads = jax.tree.map(lambda x: jnp.stack([x] * NUM_WORKERS), params())
  step = jax.jit(train_step, donate_argnums=(0, 1))
  return step.lower(params(), opt_state, worker_grads).compile().as_text()


def compiled_decorated_step(name: str, density=0.01) -> str:
  """data_parallel(...).step: the per-worker step, jitted and donated by the helper."""
  mesh = jax.make_mesh((NUM_WORKERS,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  tx = make_tx(name, density)
  parallel = exdyna_jax.data_parallel(tx, mesh)

  @parallel.step
  def train_step(params, opt_state, grads):
    updates, opt_state = tx.update(jax.tree.map(lambda g: g[0], grads), opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  worker_grads = jax.tree.map(lambda x: jnp.stack([x] * NUM_WORKERS), params())
  return train_step.lower(params(), parallel.init(params()), worker_grads).compile().as_text()


def n_vector_copies(hlo: str) -> list[str]:
  pattern = re.compile(rf"= f32\[(1,)?{NUM_ELEMENTS}\]\S* copy\(")
  return [line.strip() for line in hlo.splitlines() if pattern.search(line)]


@pytest.mark.parametrize(
    ("name", "compile_step"),
    [*itertools.product(ERROR_FEEDBACK, [compiled_pmap_step, compiled_decorated_step]),
     # `dp.update` under one's own jit: the decorated step's layout, another entry.
     ("exdyna", compiled_data_parallel_step), ("chunked_topk", compiled_data_parallel_step)],
)
def test_donated_step_copies_no_residual(name, compile_step):
  hlo = compile_step(name)
  assert f"f32[{NUM_ELEMENTS}]" in hlo or f"f32[1,{NUM_ELEMENTS}]" in hlo  # the residual ...
  assert n_vector_copies(hlo) == []  # ... is never copied


@pytest.mark.parametrize("compile_step", [compiled_pmap_step, compiled_decorated_step])
def test_donated_step_with_a_density_schedule_copies_the_residual_through_its_switch(
    compile_step):
  """A dense level and two sparse ones, one switch: each level writes its own update and
  residual inside its branch (its own slots, not the largest level's), and XLA copies the
  residual in and out of the conditional, at most three ``N``-vectors, where a fixed
  density copies none."""
  hlo = compile_step("exdyna", {0: 1.0, 10: 0.05, 20: 0.01})
  assert f"f32[{NUM_ELEMENTS}]" in hlo or f"f32[1,{NUM_ELEMENTS}]" in hlo
  assert 0 < len(n_vector_copies(hlo)) <= 3


@pytest.mark.parametrize("name", ["exdyna", "micro", "topk", "cltk"])
def test_the_update_takes_the_gradients_place_once_they_are_summed_in(name):
  """A step that computes its gradient holds one N-vector of temporaries, not two.

  The gradient dies once ``a = g + m`` is formed; the dense update is filled
  after the exchange, so it can take the gradient's memory. Were its zeros
  filled at the start (a constant has no inputs), both would be alive at once.
  (hard_threshold's whole-vector selection and SparDL's padded blocks hold
  more: 2.4 and 3.5 N-vectors here.)
  """
  mesh = jax.make_mesh((NUM_WORKERS,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  tx = make_tx(name)
  parallel = exdyna_jax.data_parallel(tx, mesh)
  sizes = (256, 512, 512, 10)  # an MLP of 0.4M parameters
  weights = {f"w{i}": jnp.ones((a, b)) for i, (a, b) in enumerate(itertools.pairwise(sizes))}

  def loss(weights, inputs):
    for w in weights.values():
      inputs = jnp.tanh(inputs @ w)
    return jnp.sum(inputs)

  @parallel.step
  def train_step(weights, opt_state, inputs):
    updates, opt_state = tx.update(jax.grad(loss)(weights, inputs), opt_state, weights)
    return optax.apply_updates(weights, updates), opt_state

  inputs = jnp.ones((NUM_WORKERS * 4, sizes[0]))
  compiled = train_step.lower(weights, parallel.init(weights), inputs).compile()
  vector_bytes = 4 * sum(w.size for w in weights.values())
  assert compiled.memory_analysis().temp_size_in_bytes < 1.4 * vector_bytes


def test_the_sum_is_formed_leaf_by_leaf_in_place_on_cpu_and_concatenated_on_gpus():
  """``a = g + m`` is the same sum either way; only how the leaves reach the row differs.

  XLA:CPU emits a fused concatenation of many leaves slowly, so on CPU each
  leaf is added into its slice of the donated residual (no N-sized
  temporary, no concatenation of N); a GPU lowering keeps the one fused
  concatenation.
  """
  rng = np.random.default_rng(0)
  shapes = [(7,), (16, 3), (1,), (5, 2, 4)] * 10  # 40 leaves
  leaves = [jnp.asarray(rng.normal(size=shape), jnp.float32) for shape in shapes]
  num_elements = sum(math.prod(shape) for shape in shapes)
  residual = jnp.asarray(rng.normal(size=num_elements), jnp.float32)
  flat = np.concatenate([np.ravel(leaf) for leaf in leaves])

  accumulate = jax.jit(_feedback.accumulate, donate_argnums=1)
  for nonfinite, expected in ((0, flat + np.asarray(residual)), (2, np.asarray(residual))):
    got = accumulate(leaves, jnp.array(residual), jnp.int32(nonfinite))
    np.testing.assert_array_equal(got, expected[None])

  args = (leaves, jax.ShapeDtypeStruct((num_elements,), jnp.float32), jnp.int32(0))
  compiled = accumulate.lower(*args).compile()
  assert not re.search(rf"f32\[(1,)?{num_elements}\]\S* concatenate\(", compiled.as_text())
  assert compiled.memory_analysis().temp_size_in_bytes < 4 * num_elements
  on_gpu = accumulate.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert f"tensor<{num_elements}xf32>" in on_gpu and "stablehlo.concatenate" in on_gpu
  assert "scatter" not in on_gpu
