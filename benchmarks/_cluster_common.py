"""What both cluster workers use: the MLP they train and a barrier across processes."""

from __future__ import annotations

import itertools

import jax
import numpy as np
import optax


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


def barrier(mesh, axis: str, value: float = 0.0) -> float:
  """Waits for every process; returns the largest ``value`` of any process."""
  local = np.full((jax.local_device_count(),), value, np.float32)
  values = jax.make_array_from_process_local_data(jax.sharding.NamedSharding(mesh, jax.P(axis)),
                                                  local)
  largest = jax.jit(jax.shard_map(lambda v: jax.lax.pmax(v, axis), mesh=mesh,
                                  in_specs=jax.P(axis), out_specs=jax.P()))(values)
  return float(np.asarray(largest.addressable_data(0)).reshape(-1)[0])
