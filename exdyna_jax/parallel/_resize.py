"""Elastic resume: an optimizer state of ``n`` workers, resized to ``m``.

A sparsifier's state belongs to its number of workers (one residual each,
per-partition arrays of length ``n``), so a checkpoint cannot simply be
restored onto another mesh. `resize_workers` builds the state ``m`` workers
would have after a fresh ``init`` and carries over what does not depend on
the worker count:

- what the parameters are **owed**: each step applies the workers' mean of
  what they send, so the parameters are owed the mean of the old workers'
  residuals (the gradient accumulated and not yet sent); every new worker
  starts with that mean, so the new workers' mean is the old one whatever
  ``m`` (with ``chunked_topk``'s ``wire="all_reduce"``, plus what the
  owners' rounding of the mean kept: their shards, owed to every worker);
- the controller's state: threshold, step counter, target correction, and
  ExDyna's block-workload estimate when the block layout is the same for
  ``m`` workers;
- every other leaf of the chain: worker 0's copy where all workers hold
  the same (momentum after the sparsifier, counters, synced parameters),
  the workers' mean where they differ (``optax.MultiSteps``' accumulated
  gradient, `local_steps`' own parameters and inner moments, each worker's
  second moment in `sparse_adamw`). An integer leaf that differs between
  workers has no mean and is refused.

What depends on ``n`` (partitions, per-worker scales, per-partition
workloads, SparDL's rounds) is re-initialised, as ``init`` makes it; the
rebalancer and the controller find their feet again within a few steps.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from exdyna_jax.core import _collectives, _options, _stats

CARRIED_FIELDS = ("threshold", "step", "target_correction")  # identical on every worker


def resize_workers(
    tx: optax.GradientTransformation,
    state: Any,
    params: Any,
    num_workers: int,
    *,
    axis_name: str = "data",
) -> Any:
  """Resizes an optimizer state held with a leading worker axis to ``num_workers``.

  Args:
    tx: the optimizer the state belongs to (the chain, sparsifier first).
    state: its state with a leading worker axis of ``n`` on every leaf (as the
      ``shard_map`` layout of the README and `exdyna_jax.data_parallel` hold
      it), for example restored from a checkpoint onto the stored shapes.
    params: the parameters.
    num_workers: ``m``, the new number of workers.
    axis_name: the sparsifier's data-parallel axis.

  Returns:
    The state for ``m`` workers, leaves ``[m, ...]`` on the host's default
    device: place it on the new mesh as a fresh ``init`` would be (e.g.
    ``jax.device_put`` with the state's sharding).

  Raises:
    ValueError: if ``num_workers`` is below 1, the state's leaves do not
      have a common leading worker axis matching ``tx``, or an integer leaf
      differs between workers.
    NotImplementedError: for the state of a model sharded over Explicit
      mesh axes (a row per shard).
    TypeError: if ``num_workers`` is not an int.

  Example:
    Eight workers ran a few steps; the job continues on four:

    >>> import jax, jax.numpy as jnp, optax, exdyna_jax
    >>> tx = optax.chain(exdyna_jax.exdyna(0.01), optax.sgd(0.1, momentum=0.9))
    >>> params = jnp.zeros(4096)
    >>> def run(grads):  # per worker: three steps from init
    ...   state = tx.init(params)
    ...   for g in grads:
    ...     state = tx.update(g, state, params)[1]
    ...   return state
    >>> grads = jax.random.normal(jax.random.key(0), (8, 3, 4096))
    >>> state = jax.jit(jax.vmap(run, axis_name="data", axis_size=8))(grads)
    >>> smaller = exdyna_jax.resize_workers(tx, state, params, 4)
    >>> optax.tree.get(smaller, "residual").shape
    (4, 4096)
    >>> before = optax.tree.get(state, "residual").mean(0)
    >>> after = optax.tree.get(smaller, "residual").mean(0)
    >>> bool(jnp.allclose(before, after, atol=1e-6))  # what the parameters are owed is kept
    True
  """
  num_workers = _options.check_positive_int(num_workers, "num_workers")
  leading = {jnp.shape(leaf)[0] if jnp.ndim(leaf) else None for leaf in jax.tree.leaves(state)}
  if len(leading) != 1 or None in leading:
    raise ValueError(
        "resize_workers needs the state as the training step holds it: every leaf with a "
        f"leading worker axis of the same length (found leading sizes {sorted(map(str, leading))})."
    )
  if any(np.ndim(node.stats.num_workers) > 1 for node in _stats.sparsifier_states(state)):
    raise NotImplementedError(
        "resize_workers cannot resize the state of a model sharded over Explicit mesh axes "
        "yet (a row per shard after the worker axis): continue on the same number of data "
        "workers, or init a fresh state on the new mesh.")
  # Wherever they were restored: the result lives, uncommitted, on the default device.
  state, params = jax.device_get((state, params))
  try:
    fresh = jax.vmap(tx.init, in_axes=None, axis_name=axis_name, axis_size=num_workers)(params)
  except _collectives.UnboundAxisError as error:  # an axis that vmap does not bind
    unbound = str(error).split(".")[0]
    raise ValueError(
        f"resize_workers resizes a state with one worker axis, {axis_name!r}, and this tx "
        f"needs another axis bound to init ({unbound}). Pass the sparsifier's own axis as "
        "axis_name=; a hierarchical(...) state, held per node and per local device, cannot "
        "be resized: continue on the same number of nodes and local devices, or start a "
        "fresh state with tx.init on the new mesh."
    ) from None
  try:
    return jax.tree.map(
        lambda new, old: _resize(new, old, num_workers),
        fresh,
        state,
        is_leaf=_stats.is_sparsifier_state,
    )
  except ValueError as error:  # structures differ
    raise ValueError(
        f"The state does not belong to this optimizer (its tree differs from tx.init's): {error}"
    ) from None


def workers_value(leaf: np.ndarray) -> np.ndarray:
  """One leaf ``[n, ...]`` for every new worker: worker 0's where all agree, else the mean.

  Raises:
    ValueError: for an integer or boolean leaf whose workers differ.
  """
  if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
    return leaf[0]
  leaf = np.asarray(leaf)
  if (leaf == leaf[:1]).all():
    return leaf[0]
  if not np.issubdtype(leaf.dtype, np.inexact):
    first_elements = leaf.reshape(len(leaf), -1)[:, 0]
    raise ValueError(
        f"A {leaf.dtype} leaf of the state differs between workers (first elements "
        f"{first_elements}): resize_workers keeps the workers' mean of a leaf they hold apart, "
        "and an integer has none. Resize where the workers agree (after a sync, or after "
        "optax.MultiSteps emitted)."
    )
  return leaf.astype(np.float64).mean(axis=0).astype(leaf.dtype)


def _resize(new: Any, old: Any, num_workers: int) -> Any:
  if _stats.is_sparsifier_state(new) and type(old) is not type(new):
    raise ValueError(
        f"The sparsifier's state is {type(old).__name__}; tx.init makes {type(new).__name__}: "
        "it was trained with another method (or restored without a target, as plain "
        "containers). Pass the tx it was trained with; to change methods, init a fresh state."
    )
  if not _stats.is_sparsifier_state(new):
    if jnp.shape(old)[1:] != jnp.shape(new)[1:]:
      raise ValueError(
          f"A leaf of shape {jnp.shape(old)[1:]} per worker is {jnp.shape(new)[1:]} for "
          f"{num_workers} workers; only the sparsifier's own state may depend on the count."
      )
    return jnp.broadcast_to(workers_value(old), jnp.shape(new))
  carried = {}
  if "residual" in new._fields:
    owed = jnp.mean(jnp.asarray(old.residual, jnp.float32), axis=0)
    if "shard_residual" in new._fields:  # the owners' shards of the mean: owed to every worker
      owed += jnp.asarray(old.shard_residual, jnp.float32).reshape(-1)[:owed.shape[0]]
    carried["residual"] = jnp.broadcast_to(owed, new.residual.shape)
  for name in CARRIED_FIELDS:
    if name in new._fields:
      carried[name] = jnp.broadcast_to(getattr(old, name)[0], getattr(new, name).shape)
  if getattr(new, "block_workloads", None) is not None and jnp.shape(old.block_workloads)[1:] == (
      new.block_workloads.shape[1:]
  ):
    carried["block_workloads"] = jnp.broadcast_to(
        old.block_workloads[0], new.block_workloads.shape
    )
  stats = new.stats._replace(**{
      name: jnp.broadcast_to(getattr(old.stats, name)[0], getattr(new.stats, name).shape)
      for name in ("step", "threshold", "skipped_steps", "layout", *_stats.TOTALS)
  })
  return new._replace(stats=stats, **carried)
