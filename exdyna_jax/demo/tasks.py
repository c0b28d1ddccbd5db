"""The demo's tasks: a model, real bundled data, and a held-out score."""

from __future__ import annotations

import itertools
import types
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from exdyna_jax.demo import data
from exdyna_jax.demo.language_model import language_model_task
from exdyna_jax.demo.trainer import Task

DIGITS_LAYER_SIZES = (64, 256, 256, 10)
# Wide enough that a dense exchange over a 1 Gb/s link costs several times the compute.
WIDE_DIGITS_LAYER_SIZES = (64, 2048, 2048, 10)


def init_mlp(key: jax.Array, sizes: tuple[int, ...]) -> list[dict[str, jax.Array]]:
  """He-initialised dense layers ``[{"w": [a, b], "b": [b]}, ...]``."""
  layers = []
  for fan_in, fan_out in itertools.pairwise(sizes):
    key, sub = jax.random.split(key)
    layers.append({
        "w": jax.random.normal(sub, (fan_in, fan_out)) * jnp.sqrt(2.0 / fan_in),
        "b": jnp.zeros((fan_out,)),
    })
  return layers


def mlp_logits(layers: list[dict[str, jax.Array]], x: jax.Array) -> jax.Array:
  """ReLU MLP; the last layer is linear."""
  for layer in layers[:-1]:
    x = jax.nn.relu(x @ layer["w"] + layer["b"])
  return x @ layers[-1]["w"] + layers[-1]["b"]


def mlp_loss(layers: list[dict[str, jax.Array]], batch: tuple[jax.Array, jax.Array]
             ) -> jax.Array:
  """Mean softmax cross-entropy of `mlp_logits` on ``(inputs, integer labels)``."""
  inputs, labels = batch
  return optax.softmax_cross_entropy_with_integer_labels(mlp_logits(layers, inputs), labels).mean()


def digits_classifier_task(
    name: str,
    init_params: Callable[[jax.Array], Any],
    logits_fn: Callable[[Any, jax.Array], jax.Array],
) -> Task:
  """A classifier of scikit-learn's bundled digits, scored by test accuracy and loss.

  Args:
    name: the task's name.
    init_params: ``key -> params``.
    logits_fn: ``(params, images [batch, 64]) -> logits [batch, 10]``.

  Returns:
    The `Task`: softmax cross-entropy, batches drawn with replacement from
    the training split.
  """
  split = data.load_digits_split()

  def loss_fn(params, inputs, targets):
    logits = logits_fn(params, inputs)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

  def evaluate(params):
    logits = logits_fn(params, split.x_test)
    return {
        "test_accuracy": jnp.mean(jnp.argmax(logits, -1) == split.y_test),
        "test_loss": optax.softmax_cross_entropy_with_integer_labels(
            logits, split.y_test).mean(),
    }

  def sample_batch(rng: np.random.Generator, global_batch: int):
    idx = rng.integers(0, len(split.x_train), global_batch)
    return split.x_train[idx], split.y_train[idx]

  return Task(
      name=name,
      init_params=init_params,
      loss_fn=loss_fn,
      evaluate=evaluate,
      sample_batch=sample_batch,
  )


def digits_task(layer_sizes: tuple[int, ...] = DIGITS_LAYER_SIZES) -> Task:
  """An MLP on scikit-learn's bundled digits, scored by test accuracy.

  Args:
    layer_sizes: input, hidden and output widths (85,002 parameters by
      default).

  Returns:
    The `Task`.
  """
  return digits_classifier_task(
      "digits", lambda key: init_mlp(key, layer_sizes), mlp_logits
  )


TASKS = types.MappingProxyType({
    "digits": digits_task,
    "digits-wide": lambda: digits_task(WIDE_DIGITS_LAYER_SIZES),
    "lm": language_model_task,
    "lm-code": lambda: language_model_task("code"),
})
