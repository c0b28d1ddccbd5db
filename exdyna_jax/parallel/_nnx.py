"""Flax NNX across data-parallel steps: `nnx_optimizer` and `nnx_step`.

A Flax NNX training step mutates its objects (the model's parameters and
BatchNorm statistics, the optimizer, metrics, random streams) under
``nnx.jit``. `nnx_step` runs such a step, unchanged, on every worker of a
`data_parallel` mesh and says, per kind of variable, what leaves it:

- ``nnx.Param``, the optimizer's step count and the streams' counts come out
  replicated (the sparsifier makes every worker's update the same);
- the optimizer's state (the residual, ...) stays each worker's own, with a
  leading worker axis outside the step, as `data_parallel`'s ``init`` gives it;
- random keys are folded with the worker's index inside the step (each worker
  draws its own Dropout mask) and come out as they went in;
- anything else the step changes (BatchNorm statistics, metric totals, a
  variable of your own) differs from worker to worker, so the user says how
  to combine it: ``"mean"`` (the average), ``"sum"`` (each worker's change
  added up: example counts and metric totals) or ``"same"`` (a value every
  worker computes alike, such as a step counter: kept, and checked equal).
  A step that changes one without a rule is refused when it is traced.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from exdyna_jax.core import _collectives
from exdyna_jax.parallel import _sharding
from exdyna_jax.wrappers import _local_steps

_PER_WORKER, _RNG_KEY, _REPLICATED = "per worker", "rng key", "replicated"
_REPLICATED_TYPES = (nnx.Param, nnx.OptState, nnx.RngCount)  # identical on every worker
is_variable = lambda node: isinstance(node, nnx.Variable)  # noqa: E731


def nnx_optimizer(dp: _sharding.DataParallel, model: nnx.Module, *, wrt: Any = nnx.Param
                  ) -> nnx.Optimizer:
  """An ``nnx.Optimizer`` for ``dp.tx`` whose state holds one slice per worker.

  ``nnx.Optimizer(model, tx, wrt=...)`` cannot hold a sparsifier (its
  ``init`` runs per worker); this builds one whose transformation starts
  its state with `dp.init` and steps it with ``dp.tx.update``, so each
  state leaf has a leading worker axis. Step it with `nnx_step`.

  Args:
    dp: what `data_parallel` returned.
    model: the model; its ``wrt`` variables are what the optimizer trains.
    wrt: an ``nnx`` filter, as for ``nnx.Optimizer``.

  Returns:
    The optimizer; ``optimizer.update(model, grads)`` works inside `nnx_step`,
    and ``dp.stats(optimizer.opt_state)`` reads the sparsifier's stats.

  Example:
    >>> import jax, optax, exdyna_jax
    >>> from flax import nnx
    >>> mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    >>> dp = exdyna_jax.data_parallel(optax.chain(exdyna_jax.exdyna(0.01), optax.sgd(0.1)), mesh)
    >>> model = nnx.Linear(64, 64, rngs=nnx.Rngs(0))
    >>> optimizer = exdyna_jax.nnx_optimizer(dp, model, wrt=nnx.Param)
    >>> optax.tree.get(nnx.as_pure(optimizer.opt_state), "residual").shape  # one per worker
    (8, 4160)
  """
  _sharding.require_data_parallel(dp, "nnx_optimizer(dp, model, wrt=...)")
  per_worker = optax.GradientTransformationExtraArgs(  # dp.init places the params itself
      lambda params: dp.init(nnx.as_pure(params)), dp.tx.update)
  return nnx.Optimizer(model, per_worker, wrt=wrt)


def check_reduce(reduce: Mapping[type, str]) -> None:
  """Raises unless ``reduce`` maps ``nnx.Variable`` types to one of `_collectives.REDUCTIONS`."""
  for kind, how in reduce.items():
    if not (isinstance(kind, type) and issubclass(kind, nnx.Variable)):
      raise TypeError(f"reduce= maps nnx.Variable types (nnx.BatchStat, ...), got key {kind!r}.")
    if issubclass(kind, (*_REPLICATED_TYPES, nnx.OptState, nnx.RngState)):
      raise ValueError(
          f"reduce[{kind.__name__}]: parameters, optimizer state and random streams need no "
          "rule (the sparsifier's exchange keeps parameters the same on every worker); "
          "name the types the step changes otherwise, such as nnx.BatchStat."
      )
    _collectives.check_reduction(how, f"reduce[{kind.__name__}]")


def check_optimizers(objects: tuple, dp: _sharding.DataParallel) -> None:
  """Refuses an ``nnx.Optimizer`` not built by `nnx_optimizer` for ``dp``."""
  for path, node in nnx.iter_graph(objects):
    if isinstance(node, nnx.Optimizer) and node.tx.update is not dp.tx.update:
      raise TypeError(
          f"The nnx.Optimizer at {'.'.join(map(str, path))} does not step dp.tx: each "
          "worker would train on its own gradient. Build it with "
          "exdyna_jax.nnx_optimizer(dp, model, wrt=nnx.Param)."
      )


def models_under_local_steps(objects: tuple) -> list[tuple[nnx.Module, nnx.Optimizer]]:
  """Each optimizer stepping `local_steps`, with the model among ``objects`` it trains.

  The model is the module whose ``wrt`` state has the tree of the state's
  parameters (an ``nnx.Optimizer`` holds no reference to its model).

  Raises:
    TypeError: where no argument of the step is that model.
  """
  trained = []
  for _, optimizer in nnx.iter_graph(objects):
    if not isinstance(optimizer, nnx.Optimizer):
      continue
    state = _local_steps.find(nnx.as_pure(optimizer.opt_state))
    if state is None:
      continue
    tree = jax.tree.structure(state.local)
    model = next((node for _, node in nnx.iter_graph(objects)
                  if isinstance(node, nnx.Module) and not isinstance(node, nnx.Optimizer)
                  and jax.tree.structure(nnx.as_pure(nnx.state(node, optimizer.wrt))) == tree),
                 None)
    if model is None:
      raise TypeError("The optimizer steps local_steps, and no argument of the step is the model "
                      "it trains: pass the model to the step along with its optimizer.")
    trained.append((model, optimizer))
  return trained


def leaf_kinds(state: Any, reduce: Mapping[type, str]) -> tuple[tuple[str, str], ...]:
  """Says, for each array of ``state``, what leaves the step and its path."""
  kinds = []
  for path, variable in jax.tree_util.tree_flatten_with_path(state, is_leaf=is_variable)[0]:
    name = jax.tree_util.keystr(path)
    if isinstance(variable, (nnx.OptArray, nnx.OptVariable)):
      kinds.append((_PER_WORKER, name))
    elif isinstance(variable, nnx.RngKey):
      kinds.append((_RNG_KEY, name))
    elif isinstance(variable, _REPLICATED_TYPES):
      kinds.append((_REPLICATED, name))
    else:
      rule = next((how for kind, how in reduce.items() if isinstance(variable, kind)), None)
      kinds.append((rule or type(variable).__name__, name))
  return tuple(kinds)


def combine(kind: str, name: str, before: jax.Array, after: jax.Array, axis_name: str):
  """What leaves the step for one array, changed (or not) on each worker."""
  if kind == _RNG_KEY:
    return before  # as it came in, unfolded: the stream stays the same on every worker
  if after is before or kind in (_REPLICATED, _PER_WORKER):
    return after
  if kind in _collectives.REDUCTIONS:
    return _collectives.combine_workers(kind, before, after, axis_name, name=name)
  raise _collectives.no_rule_error(
      f"{name}, an nnx.{kind}", f"exdyna_jax.nnx_step(dp, reduce={{nnx.{kind}: 'mean'}})")


_OBJECT, _DATA, _CONSTANT = "object", "data", "constant"  # how nnx_step passes an argument


def argument_kind(index: int, arg: Any) -> str:
  """How `nnx_step` passes its argument ``index``: an NNX object, data split over the
  workers, or a constant every worker gets (a tree of scalars: a number, a key).

  Raises:
    TypeError: for a container that holds NNX objects.
  """
  if nnx.graph.is_graph_node(arg):
    return _OBJECT
  leaves = jax.tree.leaves(arg, is_leaf=nnx.graph.is_graph_node)
  if any(nnx.graph.is_graph_node(leaf) for leaf in leaves):
    raise TypeError(
        f"Argument {index} of the step is a {type(arg).__name__} holding NNX objects: "
        "nnx_step finds the objects among the step's arguments themselves, so pass each "
        "(the model, the optimizer, the metrics) as an argument of its own."
    )
  return _CONSTANT if leaves and all(jnp.ndim(leaf) == 0 for leaf in leaves) else _DATA


def nnx_step(dp: _sharding.DataParallel, *, reduce: Mapping[type, str] | None = None
             ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
  """Decorates a Flax NNX training step to run on every worker of ``dp``.

  The step is written as for ``nnx.jit``: it takes NNX objects (the model,
  an optimizer from `nnx_optimizer`, metrics, ``nnx.Rngs``) and data, and
  mutates the objects. Every other argument is split over the workers along
  its leading axis, but for scalars (a number, a random key, a tree of them),
  which every worker gets as they are. The decorated step is jitted
  (one compilation per graph structure, e.g. per ``model.train()`` /
  ``model.eval()``), donates the objects' arrays and puts the new ones back
  into the objects; it returns the step's return value with a leading worker
  axis on every leaf (one loss per worker, say), on a mesh of several CPU
  devices when the step has run (`DataParallel`).

  Args:
    dp: what `data_parallel` returned.
    reduce: how the workers' values of a variable type the step changes
      combine, e.g. ``{nnx.BatchStat: "mean", nnx.metrics.MetricState:
      "sum"}``; see the module docstring. Parameters, optimizer state and
      random streams need no rule.

  Returns:
    A decorator: ``step -> train_step``; ``train_step.lower(*args)`` lowers
    the program a call with ``args`` runs (to read its collectives, say).

  Raises:
    TypeError: at the first call, if the step changes a variable with no
      rule, or an ``nnx.Optimizer`` does not step ``dp.tx``; at every call,
      for an argument that holds NNX objects inside a container.

  Example:
    A model with BatchNorm, its statistics averaged over the 8 workers:

    >>> import jax, numpy as np, optax, exdyna_jax
    >>> from flax import nnx
    >>> mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    >>> dp = exdyna_jax.data_parallel(optax.chain(exdyna_jax.exdyna(0.05), optax.sgd(0.1)), mesh)
    >>> rngs = nnx.Rngs(0)
    >>> model = nnx.Sequential(nnx.Linear(8, 32, rngs=rngs), nnx.BatchNorm(32, rngs=rngs))
    >>> optimizer = exdyna_jax.nnx_optimizer(dp, model, wrt=nnx.Param)
    >>> @exdyna_jax.nnx_step(dp, reduce={nnx.BatchStat: "mean"})
    ... def train_step(model, optimizer, x):
    ...   loss, grads = nnx.value_and_grad(lambda m: (m(x) ** 2).mean())(model)
    ...   optimizer.update(model, grads)
    ...   return loss
    >>> x = np.random.default_rng(0).normal(size=(64, 8)).astype(np.float32)
    >>> losses = [train_step(model, optimizer, x) for _ in range(3)]
    >>> losses[-1].shape, int(dp.stats(optimizer.opt_state).step)  # a loss per worker
    ((8,), 3)
  """
  _sharding.require_data_parallel(dp, "nnx_step(dp, reduce=...)")
  reduce = dict(reduce or {})
  check_reduce(reduce)

  def decorator(step: Callable[..., Any]) -> Callable[..., Any]:
    @functools.cache
    def compiled(graphdef, treedef, kinds, arg_kinds):
      @functools.partial(_sharding.step_decorator, dp.mesh, dp.axis_name, own_params=False)
      def per_worker(shared, own, data, constants):
        before = merge_by_kind(shared, own, kinds)
        worker = jax.lax.axis_index(dp.axis_name)
        folded = [jax.random.fold_in(a, worker) if kind == _RNG_KEY else a
                  for a, (kind, _) in zip(before, kinds, strict=True)]
        objects = nnx.merge(graphdef, jax.tree.unflatten(treedef, folded))
        check_optimizers(objects, dp)  # when traced: once per graph structure
        trained = models_under_local_steps(objects)
        for model, optimizer in trained:  # the worker's own parameters into the step
          nnx.update(model, _local_steps.find(nnx.as_pure(optimizer.opt_state)).local)
        by_kind = {_OBJECT: iter(objects), _DATA: iter(data), _CONSTANT: iter(constants)}
        result = step(*(next(by_kind[kind]) for kind in arg_kinds))
        for model, optimizer in trained:  # the synced ones out of it
          nnx.update(model, _local_steps.find(nnx.as_pure(optimizer.opt_state)).synced)
        after, after_treedef = jax.tree.flatten(nnx.state(objects))
        if after_treedef != treedef:
          raise TypeError("The step added or removed nnx variables: create every variable "
                          "before the first step (the workers' objects must keep one shape).")
        after = [combine(kind, name, b, a, dp.axis_name)
                 for a, b, (kind, name) in zip(after, before, kinds, strict=True)]
        return (*split_by_kind(after, kinds), result)

      return per_worker

    def prepare(args):
      """``(compiled step, objects, treedef, kinds, its arguments)`` for ``args``."""
      arg_kinds = tuple(argument_kind(i, arg) for i, arg in enumerate(args))
      of_kind = lambda kind: tuple(  # noqa: E731
          arg for arg, k in zip(args, arg_kinds, strict=True) if k == kind)
      objects = of_kind(_OBJECT)
      graphdef, state = nnx.split(objects)
      arrays, treedef = jax.tree.flatten(state)
      kinds = leaf_kinds(state, reduce)
      fn = compiled(graphdef, treedef, kinds, arg_kinds)
      return fn, objects, treedef, kinds, (*split_by_kind(arrays, kinds), of_kind(_DATA),
                                           of_kind(_CONSTANT))

    @functools.wraps(step)
    def train_step(*args):
      fn, objects, treedef, kinds, inputs = prepare(args)
      shared, own, result = fn(*inputs)
      nnx.update(objects, jax.tree.unflatten(treedef, merge_by_kind(shared, own, kinds)))
      return result

    def lower(*args):  # e.g. to read the compiled program's collectives
      fn, *_, inputs = prepare(args)
      return fn.lower(*inputs)

    train_step.lower = lower
    return train_step

  return decorator


def split_by_kind(arrays: list, kinds: tuple) -> tuple[list, list]:
  """``(replicated arrays, per-worker arrays)``, each in state order."""
  own = [kind == _PER_WORKER for kind, _ in kinds]
  return ([a for a, mine in zip(arrays, own, strict=True) if not mine],
          [a for a, mine in zip(arrays, own, strict=True) if mine])


def merge_by_kind(shared: list, own: list, kinds: tuple) -> list:
  """The inverse of `split_by_kind`."""
  shared, own = iter(shared), iter(own)
  return [next(own) if kind == _PER_WORKER else next(shared) for kind, _ in kinds]
