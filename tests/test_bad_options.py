"""Options and models at the edges: what each sparsifier accepts, and the errors it names."""

from __future__ import annotations

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import exdyna_jax
from tests import harness
from tests.harness import AXIS

METHODS_WITH_DENSITY = harness.SPARSIFYING


def init_per_worker(tx, params, num_workers=2):
  return jax.vmap(tx.init, in_axes=None, axis_name=AXIS, axis_size=num_workers)(params)


@pytest.mark.parametrize("name", exdyna_jax.available_sparsifiers())
def test_a_model_with_no_elements_is_refused_by_name(name):
  options = {} if name == "dense" else {"density": 0.01}
  tx = exdyna_jax.get_sparsifier(name, **options)
  with pytest.raises(ValueError, match=r"no elements.*Leave empty parameters out"):
    init_per_worker(tx, {"w": jnp.zeros((0,)), "b": jnp.zeros((0, 3))})


@pytest.mark.parametrize(
    "density", [np.float32(0.25), np.float64(0.25), jnp.float32(0.25), np.array(0.25)]
)
@pytest.mark.parametrize("name", METHODS_WITH_DENSITY)
def test_numpy_and_jax_scalars_are_numbers(name, density):
  params = {"w": jnp.zeros((64,))}
  from_scalar = init_per_worker(exdyna_jax.get_sparsifier(name, density=density), params)
  from_float = init_per_worker(exdyna_jax.get_sparsifier(name, density=0.25), params)
  chex.assert_trees_all_equal(from_scalar, from_float)


def test_integer_and_factor_options_take_numpy_scalars():
  params = {"w": jnp.zeros((4096,))}
  tx = exdyna_jax.exdyna(0.01, num_blocks=np.int64(64), capacity_factor=np.float32(1.5))
  state = init_per_worker(tx, params, num_workers=4)
  assert int(state.partition_sizes[0].sum()) == 64
  hard = exdyna_jax.hard_threshold(threshold=np.float32(0.5), capacity=np.int32(8))
  assert float(init_per_worker(hard, params).stats.threshold[0]) == 0.5


@pytest.mark.parametrize("factor", [float("inf"), float("nan"), 0.0, -1.0])
@pytest.mark.parametrize(
    ("name", "option", "unit"),
    [("exdyna", "capacity_factor", "k / n;"), ("micro", "capacity_factor", "k / n;"),
     ("hard_threshold", "capacity_per_k", r"k\)")],
)
def test_capacity_multiples_must_be_positive_and_finite_and_say_their_unit(
    name, option, unit, factor):
  """A partitioned method's buffer is a multiple of k / n; hard threshold's (over all N) of k."""
  match = rf"{option} must be positive and finite \(\w.* multiple of {unit}"
  with pytest.raises(ValueError, match=match):
    exdyna_jax.get_sparsifier(name, density=0.01, **{option: factor})


@pytest.mark.parametrize("value", ["no", 0, "auto", np.zeros(1)])
def test_spill_must_be_a_bool_or_none(value):
  with pytest.raises(TypeError, match="spill must be True, False or None"):
    exdyna_jax.exdyna(0.01, spill=value)


@pytest.mark.parametrize("value", [True, "0.01", None, [0.01], np.zeros(2)])
def test_non_numbers_are_refused_as_such(value):
  with pytest.raises(TypeError, match="density must be a number"):
    exdyna_jax.exdyna(value)
  with pytest.raises(TypeError, match="num_blocks must be an int"):
    exdyna_jax.exdyna(0.01, num_blocks=2.5 if value is None else value)


@pytest.mark.parametrize("name", ["exdyna", "topk", "spardl"])
def test_without_params_a_regrouped_tree_of_the_same_size_is_refused(name):
  """init() sees only N; the first update lays the residual out by its gradient
  tree, and an update(params=None) on a tree of the same size laid out
  otherwise stops, naming its leaves, instead of adding residuals to other leaves."""
  tx = exdyna_jax.get_sparsifier(name, density=0.01)
  built_for = {"a": jnp.zeros((2048,)), "b": jnp.zeros((2048,))}

  @jax.jit
  def update(grads, state):
    return jax.vmap(lambda g, s: tx.update(g, s), axis_name=AXIS, axis_size=2)(grads, state)

  _, state = update(jax.tree.map(lambda p: jnp.ones((2, *p.shape)), built_for),
                    init_per_worker(tx, built_for))
  for other, leaves in (({"z": jnp.ones((2, 4096))}, r"\['z'\] \(4096,\)"),
                        ({"a": jnp.ones((2, 64, 32)), "b": jnp.ones((2, 2048))},
                         r"\['a'\] \(64, 32\), \['b'\] \(2048,\)")):
    with pytest.raises((ValueError, jax.errors.JaxRuntimeError),
                       match=rf"laid out for another parameter tree.*{leaves}"):
      jax.block_until_ready(update(other, state))
  updates, _ = update(jax.tree.map(lambda p: jnp.ones((2, *p.shape)), built_for), state)
  assert np.isfinite(updates["a"]).all()  # the tree it was laid out for steps on


@pytest.mark.parametrize("name", METHODS_WITH_DENSITY)
def test_every_sparsifier_takes_a_density_schedule_and_a_value_dtype(name):
  """The options that make sense for every method are taken by every method."""
  exdyna_jax.get_sparsifier(name, density={0: 0.1, 5: 0.01}, value_dtype="bfloat16")
  with pytest.raises(ValueError, match="value_dtype must be one of float32, bfloat16, float16"):
    exdyna_jax.get_sparsifier(name, density=0.01, value_dtype="int8")


@pytest.mark.parametrize("name", METHODS_WITH_DENSITY)
def test_an_exchange_past_int32_is_refused_at_trace_time(name):
  """A model of 2**30 elements at density 0.5 on 8 workers: where the workers' buffers
  together pass 2**31 entries, the trace stops with the count and the ways out (Top-k
  used to raise a bare OverflowError); where they do not, it traces."""
  grads = jax.ShapeDtypeStruct((8, 2**30), jnp.float32)

  def trace(tx):
    step = jax.vmap(lambda g: tx.update(g, tx.init(g)), axis_name=AXIS, axis_size=8)
    return jax.eval_shape(step, grads)

  try:
    trace(exdyna_jax.get_sparsifier(name, density=0.5))
  except ValueError as error:
    assert re.search(r"8 workers would gather 8 x [\d]+ = [\d,]+ indices a step, past the "
                     r"2,147,483,647.*Lower the density.*dense\(\)", str(error)), error
  else:
    assert name != "topk", "Top-k gathers n x k = 4 * 2**30 indices"
