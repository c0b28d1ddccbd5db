"""Per-step statistics every sparsifier keeps in its optimizer state."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax


class SparsifierStats(NamedTuple):
  """What the last step did, identical on every worker.

  Read it from any chained optimizer state with one line::

    stats = optax.tree.get(opt_state, "stats")

  Attributes:
    step: int32 number of completed steps.
    threshold: float32 threshold used at the last step (before the first
      step: the one the first step will use).
    selected: int32 ``K``, elements selected by all workers together before
      the capacity limit (the controller's and the rebalancer's input).
    transmitted: int32 distinct indices actually exchanged.
    overflow: int32 ``selected - transmitted``: elements that passed but did
      not fit the static buffers; they stay in the residual.
    workloads: int32 ``[n]`` elements selected in each partition (or by each
      worker, for methods without partitions).
    imbalance: float32 ``max(workloads) / mean(workloads)``.
    partition_starts: int32 ``[n]`` first block of each partition.
    partition_sizes: int32 ``[n]`` blocks in each partition.
    bytes_sent: int32 bytes this worker sent in the last step's collectives,
      as ring algorithms move them (static: the buffers have fixed size).
  """

  step: jax.Array
  threshold: jax.Array
  selected: jax.Array
  transmitted: jax.Array
  overflow: jax.Array
  workloads: jax.Array
  imbalance: jax.Array
  partition_starts: jax.Array
  partition_sizes: jax.Array
  bytes_sent: jax.Array


def initial_stats(
    threshold: float, partition_starts: jax.Array, partition_sizes: jax.Array
) -> SparsifierStats:
  """Statistics before the first step."""
  num_partitions = partition_sizes.shape[0]
  zero = jnp.zeros((), jnp.int32)
  return SparsifierStats(
      step=zero,
      threshold=jnp.asarray(threshold, jnp.float32),
      selected=zero,
      transmitted=zero,
      overflow=zero,
      workloads=jnp.zeros((num_partitions,), jnp.int32),
      imbalance=jnp.ones((), jnp.float32),
      partition_starts=jnp.asarray(partition_starts, jnp.int32),
      partition_sizes=jnp.asarray(partition_sizes, jnp.int32),
      bytes_sent=zero,
  )


def imbalance_of(workloads: jax.Array) -> jax.Array:
  """``max / mean`` of the workloads (1 when all are zero)."""
  total = jnp.sum(workloads)
  mean = total.astype(jnp.float32) / workloads.shape[0]
  return jnp.where(total > 0, jnp.max(workloads) / jnp.maximum(mean, 1e-30), 1.0).astype(
      jnp.float32
  )


def get_stats(opt_state: Any) -> SparsifierStats:
  """Returns the `SparsifierStats` inside a (possibly chained) optimizer state.

  Equivalent to ``optax.tree.get(opt_state, "stats")``.
  """
  return optax.tree.get(opt_state, "stats")
