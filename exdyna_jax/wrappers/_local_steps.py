"""Local steps with a compressed outer sync (DiLoCo, SparseLoCo).

Each worker takes ``H`` steps of an inner optimizer on its own batches and
talks to no one. At every ``H``-th step the pseudo-gradient ``θ_sync -
θ_local`` (how far this worker moved since the last sync, as a gradient
points) goes through a compressor, any of this package's methods: its
result is the workers' mean at what it sends, identical on every worker,
and what it does not send stays in the worker's residual for the next sync
(error feedback). The outer optimizer applies that aggregate to the synced
parameters, and every worker starts the next round from them.

With ``dense()`` and an outer Nesterov step this is DiLoCo; with a sparse
compressor and a plain outer step of rate 1 (the residual carries what the
outer momentum would) it is SparseLoCo. ``chunked_topk`` is SparseLoCo's
compressor (each worker's largest of every chunk, in a few bits);
``exdyna``'s exclusive partitions keep the traffic at the density asked
whatever the workers' number, as their selections never overlap.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from exdyna_jax.core import _collectives, _options, _stats


class LocalStepsState(NamedTuple):
  """Optimizer state of `local_steps` (per worker).

  Attributes:
    count: int32 inner steps taken.
    compressor: the compressor's state (its residual: what earlier syncs
      did not send of this worker's pseudo-gradients).
    synced: the parameters of the last sync, the same on every worker: the
      ones to evaluate and checkpoint.
    local: this worker's own parameters after its last step (the synced
      ones right after a sync).
    inner: the inner optimizer's state (this worker's).
    outer: the outer optimizer's state (the same on every worker).

  Example:
    >>> import jax, jax.numpy as jnp, optax, exdyna_jax
    >>> tx = exdyna_jax.local_steps(optax.adamw(1e-3), sync_every=30,
    ...                             compressor=exdyna_jax.exdyna(0.02))
    >>> state = jax.vmap(tx.init, in_axes=None, axis_name="data", axis_size=8)(jnp.zeros(4096))
    >>> state.synced.shape, state.compressor.residual.shape  # [worker, N] each
    ((8, 4096), (8, 4096))
  """

  count: jax.Array
  compressor: Any
  synced: Any
  local: Any
  inner: Any
  outer: Any


def local_steps(
    inner: optax.GradientTransformation,
    *,
    sync_every: int,
    compressor: optax.GradientTransformation,
    outer: optax.GradientTransformation | None = None,
) -> optax.GradientTransformationExtraArgs:
  """Local steps of ``inner`` on every worker, and a compressed outer step every ``sync_every``.

  ``update(grads, state, params)`` runs per worker (in the compressor's
  mapped axis) with this worker's gradient at its own parameters
  ``params`` (`data_parallel` passes them: they are ``state.local``). It
  returns the inner update, or at a sync the step from ``params`` to the
  new synced parameters, which are then the same on every worker.

  The pseudo-gradient of a round, ``θ_sync - θ_local``, is what the
  compressor exchanges; its density is per sync, so a run sends
  ``density / sync_every`` of the parameters per step on average.

  Args:
    inner: the optimizer each worker steps alone (``optax.adamw(...)``, with
      clipping chained before it); its state is kept across syncs.
    sync_every: ``H``, the inner steps between syncs (1 or more).
    compressor: how pseudo-gradients are exchanged: a method of this package
      (``exdyna(0.02)``, ``topk``, ``dense()`` for DiLoCo's plain mean, ...).
    outer: applied to the aggregated pseudo-gradient at each sync, on the
      synced parameters. None (default): ``optax.sgd(1.0)``, the aggregate
      applied as it is (SparseLoCo's rule: error feedback carries what the
      compressor holds back). DiLoCo's, for ``dense()``:
      ``optax.sgd(0.7, momentum=0.9, nesterov=True)``.

  Returns:
    The optax transformation; its state is a `LocalStepsState`.

  Raises:
    ValueError: for ``sync_every`` below 1 (`TypeError` for one that is not
      an int).
    TypeError: at ``init``, for a compressor that is not one of this
      package's methods.

  References:
    Douillard et al., "DiLoCo: Distributed Low-Communication Training of
    Language Models", 2023 (arXiv 2311.08105). Sarfi et al., "SparseLoCo:
    Communication-Efficient LLM Training ...", 2025 (arXiv 2508.15706).

  Example:
    Eight workers under ``jax.vmap``, two local SGD steps a round, the
    rounds' pseudo-gradients averaged exactly:

    >>> import jax, jax.numpy as jnp, optax, exdyna_jax
    >>> tx = exdyna_jax.local_steps(optax.sgd(0.1), sync_every=2, compressor=exdyna_jax.dense())
    >>> def run(grads):  # per worker: two steps of its own constant gradient
    ...   params = jnp.zeros(4)
    ...   state = tx.init(params)
    ...   for _ in range(2):
    ...     updates, state = tx.update(grads, state, params)
    ...     params = optax.apply_updates(params, updates)
    ...   return params
    >>> grads = jnp.arange(8.0)[:, None] * jnp.ones((8, 4))
    >>> params = jax.jit(jax.vmap(run, axis_name="data"))(grads)
    >>> params[:, 0]  # every worker: -0.1 * 2 steps * the mean gradient 3.5
    Array([-0.7, -0.7, -0.7, -0.7, -0.7, -0.7, -0.7, -0.7], dtype=float32)
  """
  sync_every = _options.check_positive_int(sync_every, "sync_every", "inner steps a sync")
  axis_name = getattr(compressor, "axis_name", None)  # a method's own (not hierarchical's)
  compressor = _stats.require_exchange(compressor, "local_steps' compressor")

  def one_count(count):  # batched under vmap, where the cond would run both sides
    return count if axis_name is None else _collectives.unbatched(count, axis_name)
  inner = optax.with_extra_args_support(inner)
  outer = optax.sgd(1.0) if outer is None else outer

  def init_fn(params):
    return LocalStepsState(
        count=jnp.zeros([], jnp.int32),
        compressor=compressor.init(params),
        synced=params,
        local=params,
        inner=inner.init(params),
        outer=outer.init(params),
    )

  def update_fn(updates, state, params=None, **extra_args):
    if params is None:
      raise ValueError("local_steps needs params= in update: this worker's own parameters.")
    steps, inner_state = inner.update(updates, state.inner, params, **extra_args)
    local = optax.apply_updates(params, steps)
    count = state.count + 1

    def sync():
      synced, compressor_state, outer_state = outer_step(local, state)
      to_synced = jax.tree.map(jnp.subtract, synced, params)
      return to_synced, LocalStepsState(
          count, compressor_state, synced, synced, inner_state, outer_state)

    def keep_going():
      return steps, state._replace(count=count, local=local, inner=inner_state)

    return jax.lax.cond(one_count(count) % sync_every == 0, sync, keep_going)

  def outer_step(local, state):
    """The sync: ``(new synced params, compressor state, outer state)``."""
    pseudo_gradient = jax.tree.map(jnp.subtract, state.synced, local)
    aggregate, compressor_state = compressor.update(pseudo_gradient, state.compressor,
                                                    state.synced)
    outer_steps, outer_state = outer.update(aggregate, state.outer, state.synced)
    return optax.apply_updates(state.synced, outer_steps), compressor_state, outer_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def is_local_steps_state(node: Any) -> bool:
  """Whether ``node`` is a `LocalStepsState`."""
  return isinstance(node, LocalStepsState)


def find(opt_state: Any) -> LocalStepsState | None:
  """The `LocalStepsState` inside a (possibly chained) optimizer state, or None."""
  found = [node for node in jax.tree.leaves(opt_state, is_leaf=is_local_steps_state)
           if is_local_steps_state(node)]
  if len(found) > 1:
    raise ValueError("The optimizer state holds several local_steps states: nest none in another.")
  return found[0] if found else None


def worker_params(opt_state: Any, params: Any) -> Any:
  """The parameters a worker's step takes: its own under `local_steps`, else ``params``.

  `data_parallel` keeps the synced parameters outside the step (replicated:
  what a user evaluates and checkpoints) and each worker's own in its
  `LocalStepsState`; its step hands the worker's own to the user's step.

  Raises:
    TypeError: where the local-steps state holds another tree than ``params``.
  """
  state = find(opt_state)
  if state is None:
    return params
  if jax.tree.structure(state.local) != jax.tree.structure(params):
    raise TypeError(
        "local_steps keeps each worker's own parameters in its state, and this step's params "
        f"are another tree ({jax.tree.structure(params)} against "
        f"{jax.tree.structure(state.local)}): step it with data_parallel(...).step, or with "
        "jax.shard_map / jax.vmap and the parameters per worker."
    )
  return state.local


def synced_params(opt_state: Any, params: Any) -> Any:
  """The parameters that leave a step: the synced ones under `local_steps`, else ``params``."""
  state = find(opt_state)
  return params if state is None else state.synced
