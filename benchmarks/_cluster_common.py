"""What both cluster workers use: the MLP they train and a barrier across processes."""

from __future__ import annotations

import itertools

import jax
import numpy as np
import optax

AXIS = "data"


def mlp_params(features: int, hidden: int, classes: int = 10) -> dict:
  """He-initialised MLP ``features-hidden-hidden-classes`` (ReLU) parameters.

  NumPy arrays, the same on every process (seed 0).
  """
  rng = np.random.default_rng(0)
  sizes = [features, hidden, hidden, classes]
  return {
      f"layer{i}": {
          "w": (rng.normal(size=(a, b)) * np.sqrt(2.0 / a)).astype(np.float32),
          "b": np.zeros((b,), np.float32),
      }
      for i, (a, b) in enumerate(itertools.pairwise(sizes))
  }


def mlp_logits(params: dict, inputs: jax.Array) -> jax.Array:
  """``[batch, features] -> [batch, classes]``."""
  *hidden, last = params.values()
  for layer in hidden:
    inputs = jax.nn.relu(inputs @ layer["w"] + layer["b"])
  return inputs @ last["w"] + last["b"]


def mlp_loss(params: dict, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
  """Mean softmax cross-entropy of ``(inputs, integer labels)``."""
  inputs, labels = batch
  return optax.softmax_cross_entropy_with_integer_labels(mlp_logits(params, inputs), labels).mean()


def data_mesh() -> jax.sharding.Mesh:
  """One ``AXIS`` over every device of every process (Auto)."""
  return jax.make_mesh((jax.device_count(),), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,))


def put(value: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
  """A global array of ``value`` (the same on every process) laid out as ``sharding``."""
  return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def local_value(x: jax.Array):
  """The first element of this process's first shard of ``x`` (a per-worker stat, say)."""
  return np.asarray(x.addressable_shards[0].data).reshape(-1)[0]


def barrier(mesh: jax.sharding.Mesh, value: float = 0.0) -> float:
  """Waits for every process; returns the largest ``value`` of any process."""
  local = np.full((jax.local_device_count(),), value, np.float32)
  values = jax.make_array_from_process_local_data(jax.sharding.NamedSharding(mesh, jax.P(AXIS)),
                                                  local)
  largest = jax.jit(jax.shard_map(lambda v: jax.lax.pmax(v, AXIS), mesh=mesh,
                                  in_specs=jax.P(AXIS), out_specs=jax.P()))(values)
  return float(local_value(largest))
