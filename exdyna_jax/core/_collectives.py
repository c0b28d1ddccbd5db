"""Collectives over the data-parallel axis, and what they cost.

Helpers every sparsifier uses to talk across workers: the axis size with an
error that says how to bind it, the varying-axes checks of
``jax.shard_map(check_vma=True)``, an all-gather whose result is typed
invariant where the context allows, a broadcast as one integer ``psum``, the user's
rule for combining state a step changes on every worker, bit
casts that let a float ride on an integer collective, and the bytes a ring
collective sends per worker (the model `SparsifierStats.bytes_sent` uses).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import P

INDEX_BYTES = 4
VALUE_BYTES = 4


class Sparsifier(optax.GradientTransformationExtraArgs):
  """A method of this package: an optax transformation that exchanges over one mesh axis.

  Every factory (`exdyna_jax.exdyna`, ``topk``, ..., ``dense``) returns one;
  it is an ``optax.GradientTransformationExtraArgs`` in every other way.
  `exdyna_jax.hierarchical` reads ``axis_name`` to check the level it wraps.

  Attributes:
    axis_name: the mapped axis its collectives run over.

  Example:
    >>> import exdyna_jax
    >>> exdyna_jax.topk(0.01, axis_name="node").axis_name
    'node'
  """

  axis_name: str | None = None  # a copy made with ``_replace`` names no axis

  def __new__(cls, init: Any, update: Any, axis_name: str | None = None) -> Sparsifier:
    tx = super().__new__(cls, init, update)
    tx.axis_name = axis_name
    return tx


class UnboundAxisError(ValueError):
  """A collective's axis, ``axis_name``, is not bound where it runs (`axis_size`)."""

  def __init__(self, message: str, axis_name: str):
    super().__init__(message)
    self.axis_name = axis_name


def axis_size(axis_name: str, *, unbound_message: str | None = None) -> int:
  """Number of workers on ``axis_name``, with an error that says how to bind it.

  Args:
    axis_name: the mapped axis.
    unbound_message: the error's text when the axis is not bound (default:
      how to run a sparsifier per worker).

  Raises:
    UnboundAxisError: if ``axis_name`` is not bound in the calling context.
  """
  try:
    return jax.lax.axis_size(axis_name)
  except NameError:
    raise UnboundAxisError(
        unbound_message
        or f"Axis {axis_name!r} is not bound. A sparsifier's init() and update() run "
        "per worker: call them inside jax.shard_map (mesh axis "
        f"{axis_name!r}), jax.pmap(..., axis_name={axis_name!r}) or "
        f"jax.vmap(..., axis_name={axis_name!r}, axis_size=n); with plain jax.jit "
        "use exdyna_jax.data_parallel(), and build a flax TrainState or nnx.Optimizer "
        "with exdyna_jax.create_train_state or exdyna_jax.nnx_optimizer. Or pass "
        "axis_name= to match your mesh.",
        axis_name,
    ) from None


def is_manual(axis_name: str) -> bool:
  """True under shard_map or pmap, where collectives can return invariant values."""
  return axis_name in jax.sharding.get_abstract_mesh().manual_axes


def tracks_varying(axis_name: str) -> bool:
  """True under ``shard_map(check_vma=True)``, whose types say what varies."""
  if not is_manual(axis_name):
    return False
  return is_varying(jax.lax.axis_index(axis_name), axis_name)


def is_varying(x: jax.Array, axis_name: str) -> bool:
  """Whether ``x``'s type (an array's, or a traced shape's) says it varies over ``axis_name``
  (``shard_map(check_vma=True)``)."""
  return axis_name in jax.typeof(x).manual_axis_type.varying


def unbatched(x: jax.Array, axis_name: str) -> jax.Array:
  """``x``, equal on every worker, as one value under ``vmap`` (where it may be batched).

  A ``lax.cond`` or ``lax.switch`` on a batched index becomes selects that
  run every branch. Under ``vmap`` a ``pmax`` over the workers is a local
  reduction whose result is not batched; under ``shard_map`` and ``pmap``
  (a real collective there) ``x`` is one value per device already.
  """
  return x if is_manual(axis_name) else jax.lax.pmax(x, axis_name)


def check_local(grads, axis_name: str) -> None:
  """Rejects gradients that are already reduced over ``axis_name``.

  Inside ``jax.shard_map(check_vma=True)``, ``jax.grad`` with respect to
  replicated parameters returns the gradient already ``psum``-med over the
  axis: sparsifying it would compress summed gradients after the dense traffic
  was paid. The varying-axes type tells them apart.
  """
  if not tracks_varying(axis_name):
    return
  for path, leaf in jax.tree_util.tree_flatten_with_path(grads)[0]:
    if not is_varying(leaf, axis_name):
      raise ValueError(
          f"Gradient leaf {jax.tree_util.keystr(path)} is invariant over {axis_name!r}: "
          "it was already summed across workers (jax.grad of replicated params "
          "inside shard_map all-reduces the gradient densely). Differentiate a "
          f"varying copy instead: jax.grad(loss)(jax.lax.pcast(params, {axis_name!r}, "
          "to='varying'), batch), and put the sparsifier first in the chain."
      )


def per_worker(x: jax.Array, axis_name: str) -> jax.Array:
  """Marks ``x`` as varying over ``axis_name`` where the context tracks it.

  A residual starts as zeros (invariant) but becomes each worker's own after
  the first step; inside ``jax.shard_map(check_vma=True)`` a ``lax.scan`` or
  ``fori_loop`` over steps needs the carry's type to stay the same.
  """
  if not tracks_varying(axis_name) or is_varying(x, axis_name):
    return x
  return jax.lax.pcast(x, axis_name, to="varying")


def all_gather(x: jax.Array, axis_name: str) -> jax.Array:
  """Every worker's ``x``, stacked ``[n, ...]`` (row ``w`` from worker ``w``).

  Identical on every worker, and typed so under ``shard_map`` (invariant), so
  what is computed from it can leave through ``out_specs=P()``;
  ``vmap(axis_name=...)`` has no invariant all-gather and gets the plain one.
  """
  if is_manual(axis_name):
    return jax.lax.all_gather(x, axis_name, to="invarying")
  return jax.lax.all_gather(x, axis_name)


def broadcast_from(x: jax.Array, source: jax.Array, axis_name: str) -> jax.Array:
  """Worker ``source``'s ``x`` on every worker, as one integer ``psum``.

  Every other worker contributes zeros. A ring all-reduce of ``M`` bytes
  sends ``2 (n-1) / n M`` per worker, less than the ``(n-1) M`` of gathering
  every worker's copy to keep one.

  Args:
    x: int32 array (integers add exactly).
    source: int32 scalar rank of the worker whose ``x`` is kept.
    axis_name: the data-parallel axis.

  Returns:
    ``x`` of worker ``source``, identical on every worker.
  """
  mine = jax.lax.axis_index(axis_name) == source
  return jax.lax.psum(jnp.where(mine, x, jnp.zeros_like(x)), axis_name)


def concatenate_ragged(
    x: jax.Array, counts: jax.Array, slots: int, axis_name: str
) -> tuple[jax.Array, jax.Array]:
  """Every worker's first ``counts[w]`` elements of ``x``, end to end, as one integer ``psum``.

  Worker ``w`` writes its elements at ``offsets[w] = counts[0] + ... +
  counts[w - 1]`` of a buffer of ``slots`` and every other slot is zero, so
  the sum of the buffers holds each element once: a variable-size
  all-gather whose ring all-reduce sends ``2 (n-1) / n slots`` values per
  worker, whatever the workers' counts. Elements past ``slots`` are dropped.

  Args:
    x: int32 ``[m]`` this worker's elements, each in ``[0, 2^31 - 1)``.
    counts: int32 ``[n]`` how many leading elements of ``x`` each worker
      contributes (at most ``m``), the same on every worker.
    slots: static size of the shared buffer.
    axis_name: the data-parallel axis.

  Returns:
    ``(buffer, offsets)``: int32 ``[slots]``, identical on every worker,
    with ``-1`` in the slots nobody wrote; and int32 ``[n]`` where each
    worker's elements start (they end ``counts[w]`` later, or at ``slots``).
  """
  offsets = jnp.cumsum(counts) - counts
  rank = jnp.arange(x.shape[0], dtype=jnp.int32)
  me = jax.lax.axis_index(axis_name)
  at = jnp.where(rank < counts[me], offsets[me] + rank, slots)
  # Written as x + 1 so that the zeros of the other workers mean "empty".
  mine = jnp.zeros((slots,), jnp.int32).at[at].set(x + 1, mode="drop")
  return jax.lax.psum(mine, axis_name) - 1, offsets


REDUCTIONS = ("mean", "sum", "same")


def check_reduction(how: str, where: str) -> None:
  """Raises unless ``how`` is one of `REDUCTIONS` (``where`` names the rule's key)."""
  if how not in REDUCTIONS:
    raise ValueError(f"{where} is {how!r}; it must be one of {REDUCTIONS}.")


def no_rule_error(changed: str, mean_rule: str) -> TypeError:
  """The refusal of a step that changes per-worker state with no rule to combine it.

  Args:
    changed: what the step changed, e.g. "the field 'batch_stats'".
    mean_rule: the call that averages it, e.g. "exdyna_jax.train_state_step(...)".
  """
  return TypeError(
      f"The step changes {changed}, which each worker computes from its own batch, so the "
      f"workers' values may differ. Say how to combine them: {mean_rule} for an average "
      "(BatchNorm statistics), 'sum' to add up each worker's change (example counts, metric "
      "totals), or 'same' for a value every worker computes alike (a step counter: kept, "
      "and checked equal)."
  )


def combine_workers(how: str, before: jax.Array, after: jax.Array, axis_name: str, *,
                    name: str) -> jax.Array:
  """One value from every worker's ``after``, by the user's rule ``how``.

  For state a step changes outside the optimizer (BatchNorm statistics, metric
  totals), which each worker computes from its own batch: ``"mean"`` averages
  the workers' values; ``"sum"`` adds each worker's change to ``before``
  (counts, totals), so a counter counts every worker's examples once;
  ``"same"`` keeps a value every worker computes alike (a step counter) and
  checks that they do (`same_on_every_worker`).

  Raises:
    TypeError: for ``"mean"`` of integers (``name`` says which value).
  """
  if how == "mean":
    if not jnp.issubdtype(after.dtype, jnp.inexact):
      raise TypeError(
          f"reduce='mean' for {name} of dtype {after.dtype}: use 'sum' for counts of each "
          "worker's examples, or 'same' for a counter every worker advances alike.")
    return jax.lax.pmean(after, axis_name)
  if how == "same":
    return same_on_every_worker(after, axis_name, name=name)
  return before + jax.lax.psum(after - before, axis_name)


def same_on_every_worker(value: jax.Array, axis_name: str, *, name: str) -> jax.Array:
  """``value``, which every worker must hold alike; a step where they differ stops.

  One ``pmin`` and one ``pmax`` tell every worker the range; where it is not a
  single value, the step raises on the host (`on_host_if`: a `ValueError`
  naming ``name``, surfacing as a ``JaxRuntimeError`` under ``jit``).
  """
  as_int = value.dtype == jnp.bool_
  low, high = (reduce(value.astype(jnp.int32) if as_int else value, axis_name)
               for reduce in (jax.lax.pmin, jax.lax.pmax))
  differ = jnp.any(low != high)
  stopped = on_host_if(differ, functools.partial(_raise_if_differ, name=name), differ)
  return jnp.where(stopped > 0, jnp.zeros_like(high), high).astype(value.dtype)


def _raise_if_differ(differ: Any, *, name: str) -> None:
  if bool(np.any(differ)):
    raise ValueError(
        f"reduce='same' for {name}, but the workers' values differ: it depends on each "
        "worker's batch. Use 'mean' to average it or 'sum' to add up each worker's change."
    )


def on_host(callback: Callable[..., None], *args: jax.Array) -> jax.Array:
  """Runs ``callback(*args)`` on the host; returns an int32 0 to keep in the results.

  A ``jax.pure_callback``, not a ``jax.debug.callback``: JAX dispatches a
  program with an effect outside its fast path, every call, and a pure
  callback is dropped unless its result is used, so the caller adds the 0
  it returns into a result. Where the context's mesh has axes that are not
  manual, the callback runs in a ``shard_map`` over them, once on every
  device, taking ``args`` (replicated scalars): JAX refuses a callback
  under partly automatic sharding, and under wholly automatic sharding it
  runs it on one device, whose raise would leave the others waiting for
  its result. (Workers simulated with ``vmap`` over arrays sharded across
  devices without a mesh context are that last case: a raise there is
  printed and the run stops when XLA gives up waiting.)
  """
  def zero_after(*host_args):  # batched under vmap: all args broadcast to the batch's shape
    callback(*host_args)
    return np.zeros(np.shape(host_args[0]), np.int32)

  def call(*args):
    return jax.pure_callback(zero_after, jax.ShapeDtypeStruct((), jnp.int32), *args,
                             vmap_method="broadcast_all")

  mesh = jax.sharding.get_abstract_mesh()
  automatic = frozenset(name for name, kind in zip(mesh.axis_names, mesh.axis_types, strict=True)
                        if kind != jax.sharding.AxisType.Manual)
  if not automatic:
    return call(*args)
  return jax.shard_map(call, in_specs=P(), out_specs=P(), axis_names=automatic,
                       check_vma=False)(*args)


def on_host_if(predicate: jax.Array, callback: Callable[..., None], *args: jax.Array
               ) -> jax.Array:
  """`on_host` in a conditional on ``predicate`` (the same on every worker); int32 0.

  The host runs nothing on a step where ``predicate`` is false (on a GPU it
  reads the predicate back). The caller keeps the 0 in a result, as for
  `on_host`.
  """
  return jax.lax.cond(predicate, functools.partial(on_host, callback, *args),
                      lambda: jnp.int32(0))


def ring_all_gather_bytes(num_workers: int, message_bytes: int) -> int:
  """Bytes one worker sends in a ring all-gather of ``M`` bytes per worker: ``(n-1) M``."""
  return (num_workers - 1) * message_bytes


def ring_all_reduce_bytes(num_workers: int, message_bytes: int) -> int:
  """Bytes one worker sends in a ring all-reduce of ``M`` bytes: ``2 (n-1) / n M``."""
  return 2 * (num_workers - 1) * message_bytes // num_workers


def float_bits(x: jax.Array) -> jax.Array:
  """The bits of a float32 as an int32, to ride on an integer collective."""
  return jax.lax.bitcast_convert_type(jnp.asarray(x, jnp.float32), jnp.int32)


def bits_float(x: jax.Array) -> jax.Array:
  """Inverse of `float_bits`. On non-negative floats both orders agree."""
  return jax.lax.bitcast_convert_type(jnp.asarray(x, jnp.int32), jnp.float32)


def words_of(count: int, dtype: jnp.dtype) -> int:
  """int32 words that `values_bits` packs ``count`` values of ``dtype`` into."""
  return -(-count * jnp.dtype(dtype).itemsize // INDEX_BYTES)


def values_bits(values: jax.Array, dtype: jnp.dtype) -> jax.Array:
  """``[..., m]`` values of ``dtype`` packed into ``[..., words_of(m)]`` int32 words.

  To ride on an integer collective next to int32 indices: a float32 is one
  word, two bfloat16 or float16 share one (an odd count is padded).
  """
  per_word = INDEX_BYTES // jnp.dtype(dtype).itemsize
  if per_word == 1:
    return jax.lax.bitcast_convert_type(values.astype(dtype), jnp.int32)
  count = values.shape[-1]
  pad = [(0, 0)] * (values.ndim - 1) + [(0, -count % per_word)]
  narrow = jnp.pad(values.astype(dtype), pad)
  return jax.lax.bitcast_convert_type(
      narrow.reshape(*values.shape[:-1], -1, per_word), jnp.int32)


def bits_values(words: jax.Array, dtype: jnp.dtype, count: int) -> jax.Array:
  """Inverse of `values_bits`: the first ``count`` values, as float32."""
  narrow = jax.lax.bitcast_convert_type(words, dtype)  # [..., w] or [..., w, per_word]
  narrow = narrow.reshape(*words.shape[:-1], -1)[..., :count]
  return narrow.astype(jnp.float32)
