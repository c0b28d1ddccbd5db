"""Flax ``TrainState`` across data-parallel steps: `create_train_state` and `train_state_step`.

A linen training step takes a ``flax.training.train_state.TrainState`` and
returns a new one. `train_state_step` runs such a step, unchanged, on every
worker of a `data_parallel` mesh and says, per field, what leaves it:

- ``params`` and ``step`` come out replicated (the sparsifier makes every
  worker's update the same);
- ``opt_state`` stays each worker's own (the residual, ...), with a leading
  worker axis outside the step, as `create_train_state` builds it;
- any other field the step changes (``batch_stats`` of a subclass, say)
  differs from worker to worker, so the user says how to combine it:
  ``"mean"`` (the average), ``"sum"`` (each worker's change added up) or
  ``"same"`` (a value every worker computes alike, such as ``epoch_steps +
  1``: kept, and checked equal). A step that changes one without a rule is
  refused when it is traced.

As with ``dp.step``, the batch after the state is split over the workers
along its leading axis and further arguments are replicated: pass a random
key for Dropout there and fold it with the worker's index,
``jax.random.fold_in(key, jax.lax.axis_index(dp.axis_name))``, so that each
worker draws its own mask.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import optax
from flax.training.train_state import TrainState

from exdyna_jax.core import _collectives
from exdyna_jax.parallel import _sharding
from exdyna_jax.wrappers import _local_steps

_FIELDS_WITHOUT_RULE = ("params", "opt_state", "step")  # what the step itself keeps right


def create_train_state(dp: _sharding.DataParallel, state_class: type = TrainState, *,
                       apply_fn: Callable, params: Any, **fields: Any) -> Any:
  """``state_class.create(apply_fn=..., params=..., tx=dp.tx)``, its state one slice per worker.

  ``TrainState.create`` cannot hold a sparsifier (its ``init`` runs per
  worker); this builds the same state with `data_parallel`'s ``init``, so
  each ``opt_state`` leaf has a leading worker axis. Step it with
  `train_state_step`.

  Args:
    dp: what `data_parallel` returned.
    state_class: ``TrainState`` or a subclass (one with ``batch_stats``, say).
    apply_fn: as for ``TrainState.create``, usually ``model.apply``.
    params: the parameters ``dp.tx`` trains.
    **fields: the subclass's other fields.

  Returns:
    The state; ``dp.stats(state.opt_state)`` reads the sparsifier's stats.

  Example:
    >>> import jax, optax, exdyna_jax
    >>> import flax.linen as nn
    >>> mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    >>> dp = exdyna_jax.data_parallel(optax.chain(exdyna_jax.exdyna(0.01), optax.sgd(0.1)), mesh)
    >>> model = nn.Dense(64)
    >>> params = model.init(jax.random.key(0), jax.numpy.ones((1, 64)))["params"]
    >>> state = exdyna_jax.create_train_state(dp, apply_fn=model.apply, params=params)
    >>> optax.tree.get(state.opt_state, "residual").shape  # one per worker
    (8, 4160)
  """
  _sharding.require_data_parallel(dp, "create_train_state(dp, apply_fn=..., params=...)")
  state = state_class.create(apply_fn=apply_fn, params=params, tx=optax.identity(), **fields)
  return state.replace(tx=dp.tx, opt_state=dp.init(params))


def check_reduce(reduce: Mapping[str, str]) -> None:
  """Raises unless ``reduce`` maps field names other than the three kept right to a rule."""
  for field, how in reduce.items():
    if field in _FIELDS_WITHOUT_RULE:
      raise ValueError(
          f"reduce[{field!r}]: params, opt_state and step need no rule (the sparsifier's "
          "exchange keeps params the same on every worker); name the fields the step "
          "changes otherwise, such as 'batch_stats'."
      )
    _collectives.check_reduction(how, f"reduce[{field!r}]")


def check_state(state: Any, dp: _sharding.DataParallel, reduce: Mapping[str, str]) -> None:
  """Refuses a state not built by `create_train_state` for ``dp``, or a rule for no field."""
  if not isinstance(state, TrainState):
    raise TypeError(f"The first argument must be a flax TrainState, got {type(state).__name__}.")
  if state.tx is not dp.tx:
    raise TypeError(
        "The TrainState's tx is not dp.tx: each worker would train on its own gradient. "
        "Build it with exdyna_jax.create_train_state(dp, apply_fn=..., params=...)."
    )
  names = {field.name for field in dataclasses.fields(state)}
  if unknown := sorted(set(reduce) - names):
    raise ValueError(f"reduce= names {unknown}, not fields of {type(state).__name__}.")


def refuse_changed_static_field(name: str, before: Any, after: Any) -> None:
  """Raises if the step changed a ``pytree_node=False`` field (part of the program, not data)."""
  try:
    same = before is after or bool(before == after)
  except Exception:  # arrays, objects without a plain ==
    same = False
  if not same:
    raise TypeError(
        f"The step changes the field {name!r}, declared pytree_node=False: a static field is "
        "part of the compiled program, not data the step returns, so a step cannot change "
        f"it. Make it data (flax.struct.field(pytree_node=True)) with a reduce rule, e.g. "
        f"reduce={{{name!r}: 'same'}}, or change it outside the step."
    )


def combine_fields(before: Any, after: Any, reduce: Mapping[str, str], axis_name: str) -> Any:
  """``after``, each field it changed (but params, opt_state, step) combined by its rule."""
  combined = {}
  for field in dataclasses.fields(after):
    if not field.metadata.get("pytree_node", True):
      refuse_changed_static_field(field.name, getattr(before, field.name),
                                  getattr(after, field.name))
      continue
    if field.name in _FIELDS_WITHOUT_RULE:
      continue
    old, new = getattr(before, field.name), getattr(after, field.name)
    old_leaves, new_leaves = jax.tree.leaves(old), jax.tree.leaves(new)
    if all(a is b for a, b in zip(old_leaves, new_leaves, strict=True)):
      continue  # unchanged: the same value on every worker
    if field.name not in reduce:
      raise _collectives.no_rule_error(
          f"the field {field.name!r}",
          f"exdyna_jax.train_state_step(dp, reduce={{{field.name!r}: 'mean'}})")
    combine = functools.partial(_collectives.combine_workers, reduce[field.name],
                                axis_name=axis_name, name=field.name)
    combined[field.name] = jax.tree.map(combine, old, new)
  return after.replace(**combined)


def train_state_step(dp: _sharding.DataParallel, *, reduce: Mapping[str, str] | None = None
                     ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
  """Decorates a Flax ``TrainState`` training step to run on every worker of ``dp``.

  The step is written as for one device: ``step(state, batch, *args) ->
  state`` or ``(state, *aux)``, with ``state.apply_gradients(grads=...)``
  applying the worker's own gradient (``jax.grad``, no ``pmean``). ``batch``
  is split over the workers along its leading axis; ``args`` are replicated
  (a random key, say). The
  decorated step is jitted, donates the state and returns what the step
  returns, with a leading worker axis on every ``aux`` leaf; on a mesh of
  several CPU devices it returns when the step has run (`DataParallel`).

  Args:
    dp: what `data_parallel` returned.
    reduce: how the workers' values of each field the step changes combine,
      by field name, e.g. ``{"batch_stats": "mean"}``; see the module
      docstring. ``params``, ``opt_state`` and ``step`` need no rule.

  Returns:
    A decorator: ``step -> train_step``; ``train_step.lower(state, batch,
    *args)`` lowers the program a call runs.

  Raises:
    TypeError: at the first call, if the step changes a field with no rule,
      or the state's ``tx`` is not ``dp.tx``.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, optax, exdyna_jax
    >>> import flax.linen as nn
    >>> mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    >>> dp = exdyna_jax.data_parallel(optax.chain(exdyna_jax.exdyna(0.05), optax.sgd(0.1)), mesh)
    >>> model = nn.Dense(8)
    >>> x = np.random.default_rng(0).normal(size=(64, 8)).astype(np.float32)
    >>> params = model.init(jax.random.key(0), x)["params"]
    >>> state = exdyna_jax.create_train_state(dp, apply_fn=model.apply, params=params)
    >>> @exdyna_jax.train_state_step(dp)
    ... def train_step(state, x):  # per worker: its own 8 rows
    ...   loss_fn = lambda p: jnp.mean((state.apply_fn({"params": p}, x) - x) ** 2)
    ...   loss, grads = jax.value_and_grad(loss_fn)(state.params)
    ...   return state.apply_gradients(grads=grads), loss
    >>> for _ in range(3):
    ...   state, losses = train_step(state, x)
    >>> losses.shape, int(state.step), int(dp.stats(state.opt_state).step)
    ((8,), 3, 3)
  """
  _sharding.require_data_parallel(dp, "train_state_step(dp, reduce=...)")
  reduce = dict(reduce or {})
  check_reduce(reduce)

  def decorator(step: Callable[..., Any]) -> Callable[..., Any]:
    @functools.partial(_sharding.step_decorator, dp.mesh, dp.axis_name, own_params=False)
    def per_worker(shared, opt_state, batch, *args):
      state = shared.replace(
          opt_state=opt_state, params=_local_steps.worker_params(opt_state, shared.params))
      outputs = step(state, batch, *args)
      new_state, aux = (outputs, None) if isinstance(outputs, TrainState) else (
          outputs[0], tuple(outputs[1:]))
      if type(new_state) is not type(state) or new_state.tx is not state.tx:
        raise TypeError(f"{getattr(step, '__name__', 'The step')} must return the state it was "
                        "given, updated (state.apply_gradients(...)), first.")
      new_state = combine_fields(state, new_state, reduce, dp.axis_name)
      params = _local_steps.synced_params(new_state.opt_state, new_state.params)
      return new_state.replace(opt_state=None, params=params), new_state.opt_state, aux

    def inputs(state, batch, args):
      check_state(state, dp, reduce)
      return state.replace(opt_state=None), state.opt_state, batch, *args

    @functools.wraps(step)
    def train_step(state, batch, *args):
      shared, opt_state, aux = per_worker(*inputs(state, batch, args))
      state = shared.replace(opt_state=opt_state)
      return state if aux is None else (state, *aux)

    train_step.lower = lambda state, batch, *args: per_worker.lower(*inputs(state, batch, args))
    return train_step

  return decorator
