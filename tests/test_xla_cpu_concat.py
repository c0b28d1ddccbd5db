"""`benchmarks/xla_cpu_concat.py` times the error-feedback shell's accumulation."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import xla_cpu_concat
from exdyna_jax.shell import _feedback


def test_the_leaves_are_the_cluster_benchmarks_mlp():
  shapes = xla_cpu_concat.mlp_leaf_shapes()
  assert len(shapes) == 6
  assert sum(map(math.prod, shapes)) == 4_743_178  # the cluster step's N


def test_the_transformer_tree_has_many_leaves():
  shapes = xla_cpu_concat.transformer_leaf_shapes()
  assert len(shapes) == 122 and sum(map(math.prod, shapes)) == 54_176_256
  for name in ("transformer_layout_order", "transformer_leaf_by_leaf"):  # the MLP's sums
    assert xla_cpu_concat.variants()[name][0] == shapes


@pytest.mark.parametrize("name", [name for name in xla_cpu_concat.variants()
                                  if name != "plain_pass" and not name.startswith("transformer")])
def test_each_variant_is_the_shells_accumulation(name):
  shapes, accumulate = xla_cpu_concat.variants()[name]
  keys = jax.random.split(jax.random.key(0), len(shapes) + 1)
  leaves = [jax.random.normal(key, shape) for key, shape in zip(keys[1:], shapes, strict=True)]
  residual = jax.random.normal(keys[0], (sum(map(math.prod, shapes)),))
  for skip in (0, 3):  # a step taken, a step skipped
    expected = _feedback.accumulate(leaves, residual, jnp.int32(skip))
    got = jax.jit(accumulate)(residual[None], leaves, jnp.int32(skip))
    np.testing.assert_array_equal(got, expected)


def test_a_variant_is_timed_on_four_devices():
  assert xla_cpu_concat.median_ms([(64,), (8, 32)], xla_cpu_concat.variants()["rows"][1],
                                  repeats=2) > 0
