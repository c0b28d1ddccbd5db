"""Data-parallel training with a sparsifier: the wiring of ``jax.shard_map`` and ``jax.jit``.

A sparsifier needs each worker's *local* gradient, and its state (the
residual above all) differs from worker to worker. `data_parallel` hides the
``jax.shard_map`` that gives both: a per-worker training step sees its own
batch shard and its own state, while outside it every leaf of the optimizer
state carries a leading worker axis sharded over the mesh axis, so no
partition spec is ever written by hand. Under plain ``jax.jit`` (where the
gradient of a loss over a sharded batch is the global one, already summed
by a dense all-reduce XLA inserts) its ``value_and_grad`` returns the
per-worker gradients stacked along that axis instead.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import P

from exdyna_jax.core import _stats
from exdyna_jax.parallel import _dp_checks, _mesh_axes
from exdyna_jax.parallel._worker_map import per_worker_map
from exdyna_jax.shell import _per_shard
from exdyna_jax.wrappers import _local_steps


def add_worker_axis(tree):
  """Adds a leading worker axis of size 1 to every leaf (per-worker state out of shard_map)."""
  return jax.tree.map(lambda x: x[None], tree)


def drop_worker_axis(tree):
  """Drops the leading worker axis of every leaf (per-worker state into shard_map)."""
  return jax.tree.map(lambda x: x[0], tree)


def first_worker(tree: Any, mesh: jax.sharding.Mesh) -> Any:
  """Worker 0's slice of every leaf, replicated: one program, not one dispatch per leaf.

  The worker axis is gathered first: an Explicit data axis (``jax.make_mesh``'s
  default) types ``x[0]`` of a leaf split over it as a slice JAX does not
  take.
  """
  return _drop_worker_axis(jax.device_put(tree, jax.NamedSharding(mesh, P())))


_drop_worker_axis = jax.jit(drop_worker_axis)


class DataParallel(NamedTuple):
  """Data-parallel training with a sparsifier, under ``jax.jit`` or ``jax.shard_map``.

  Two ways to write the training step: decorate a *per-worker* step with
  ``step`` (it sees its own batch shard and its own optimizer state, no
  worker axis; the shortest path), or call ``value_and_grad`` and ``update``
  from a step of your own under plain ``jax.jit`` (pjit style).

  Attributes:
    init: ``params -> opt_state``; every state leaf has a leading axis of size
      ``n`` sharded over the mesh axis (one slice per worker). It raises a
      ``ValueError`` where the gradient of some leaf would reach no
      sparsifier (``optax.masked``, a ``multi_transform`` group without one,
      no sparsifier at all): exchange such leaves with `exdyna_jax.dense` in
      a group of their own.
    step: decorator: ``per_worker_step -> train_step``.
      ``per_worker_step(params, opt_state, batch, *args) -> (params,
      opt_state, *aux)`` runs on every worker with the replicated
      ``params``, this worker's optimizer state (no worker axis) and its
      shard of ``batch`` (leading axis split over the mesh axis); ``args``
      are replicated. ``train_step`` takes and returns the same, with the
      state's worker axis; it is jitted, with ``params`` and ``opt_state``
      donated (updated in place), and each ``aux`` leaf (a loss, say) comes
      back with a leading worker axis, one value per worker. On a mesh of
      several CPU devices ``train_step`` returns when the step has run
      (XLA:CPU's collectives deadlock when steps queue up, :doc:`/multihost`);
      elsewhere it returns at once, as a jitted function does.
    update: ``(worker_grads, opt_state, params) -> (updates, opt_state)``;
      ``worker_grads`` leaves have the leading worker axis (as
      ``value_and_grad`` returns them); ``updates`` are replicated and shaped
      like ``params``.
    value_and_grad: ``loss_fn -> f``, with ``f(params, batch, *args) ->
      (mean loss, worker_grads)``: each worker differentiates ``loss_fn`` on
      its own shard of ``batch`` (leading axis sharded over the mesh axis), and
      no gradient is all-reduced.
    stats: ``opt_state -> SparsifierStats`` without the worker axis (the
      same on every worker); on Explicit model axes, the whole model's counts.
    tx: the optimizer it wires.
    mesh: the mesh it runs on.
    axis_name: the data-parallel mesh axis.

  Example:
    ``value_and_grad`` returns one gradient per worker, stacked on a leading
    axis sharded over ``"data"`` (shapes only, with ``jax.eval_shape``):

    >>> import jax, jax.numpy as jnp, optax, exdyna_jax
    >>> mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    >>> dp = exdyna_jax.data_parallel(optax.chain(exdyna_jax.topk(0.01), optax.sgd(0.1)), mesh)
    >>> def loss_fn(params, batch):
    ...   return jnp.mean((batch @ params["w"]) ** 2)
    >>> params, batch = {"w": jnp.zeros((64, 4))}, jnp.ones((32, 64))
    >>> loss, grads = jax.eval_shape(dp.value_and_grad(loss_fn), params, batch)
    >>> loss.shape, grads["w"].shape
    ((), (8, 64, 4))
    >>> dp._fields
    ('init', 'step', 'update', 'value_and_grad', 'stats', 'tx', 'mesh', 'axis_name')
  """

  init: Callable[[Any], Any]
  step: Callable[[Callable[..., tuple]], Callable[..., tuple]]
  update: Callable[..., tuple[Any, Any]]
  value_and_grad: Callable[[Callable[..., jax.Array]], Callable[..., tuple[jax.Array, Any]]]
  stats: Callable[[Any], Any]
  tx: optax.GradientTransformation
  mesh: jax.sharding.Mesh
  axis_name: str | tuple[str, ...]


def data_parallel(
    tx: optax.GradientTransformation,
    mesh: jax.sharding.Mesh,
    *,
    axis_name: str | Sequence[str] = "data",
) -> DataParallel:
  """Wires an optimizer whose first stage is a sparsifier for data-parallel training.

  Args:
    tx: the optimizer, e.g. ``optax.chain(exdyna_jax.exdyna(...), ...)``.
    mesh: a mesh with an axis called ``axis_name``. Its other axes stay
      XLA's: parameters sharded over them (tensor parallel) keep their
      shardings; everything else is replicated over them. On Explicit axes
      each device sparsifies the shards it holds: the method's state has one
      row per device along them after the worker axis (:doc:`/usage`).
    axis_name: the data-parallel mesh axis, or a tuple of them: the workers
      are their devices (``("node", "local")`` for a `hierarchical`
      sparsifier, whose state differs per device on both axes).

  Returns:
    A `DataParallel` (``init``, ``step``, ``update``, ``value_and_grad``, ``stats``).

  Raises:
    ValueError: if ``mesh`` has no axis ``axis_name``; from ``init``, on a
      mesh of several axes, if the optimizer communicates over an axis of
      more than one device that ``axis_name`` leaves out (a `hierarchical`
      sparsifier's fast axis: the batch and the state would be replicated
      over it), or never over one that it names.
    NotImplementedError: from ``init`` and the step, for params sharded over a data axis (FSDP).

  Warns:
    UserWarning: for an axis of one device (nothing to exchange; the usual
      cause is a CPU machine without ``jax_num_cpu_devices``).

  Example:
    The shortest path: a per-worker step, decorated. A linear model on the
    8 forced CPU devices, each worker with its own eighth of the batch:

    >>> import jax, jax.numpy as jnp, optax, exdyna_jax
    >>> mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    >>> tx = optax.chain(exdyna_jax.exdyna(0.01, num_blocks=32), optax.sgd(0.1))
    >>> dp = exdyna_jax.data_parallel(tx, mesh)
    >>> def loss_fn(params, batch):
    ...   x, y = batch
    ...   return jnp.mean((x @ params["w"] - y) ** 2)
    >>> @dp.step
    ... def train_step(params, opt_state, batch):  # per worker: no worker axis here
    ...   loss, grads = jax.value_and_grad(loss_fn)(params, batch)  # its own gradient
    ...   updates, opt_state = tx.update(grads, opt_state, params)
    ...   return optax.apply_updates(params, updates), opt_state, loss
    >>> params = {"w": jnp.zeros((64, 64))}
    >>> opt_state = dp.init(params)
    >>> x = jax.random.normal(jax.random.key(0), (32, 64))
    >>> for _ in range(5):
    ...   params, opt_state, losses = train_step(params, opt_state, (x, 2 * x))
    >>> losses.shape  # one loss per worker
    (8,)
    >>> stats = dp.stats(opt_state)  # identical on every worker: no worker axis
    >>> int(stats.step), stats.partition_sizes.shape  # a size per partition
    (5, (8,))

    The same model under plain ``jax.jit``, with the batch sharded over
    ``"data"`` and no ``shard_map`` in user code:

    >>> from jax import P
    >>> replicated = jax.NamedSharding(mesh, P())  # as train_step returns them: no recompile
    >>> params = jax.device_put({"w": jnp.zeros((64, 64))}, replicated)
    >>> opt_state = dp.init(params)
    >>> residual = optax.tree.get(opt_state, "residual")  # one per worker
    >>> residual.shape, residual.sharding.spec == P("data")
    ((8, 4096), True)
    >>> @jax.jit
    ... def jit_train_step(params, opt_state, batch):  # batch sharded P("data")
    ...   loss, grads = dp.value_and_grad(loss_fn)(params, batch)
    ...   updates, opt_state = dp.update(grads, opt_state, params)
    ...   return optax.apply_updates(params, updates), opt_state, loss
    >>> x = jax.random.normal(jax.random.key(0), (32, 64))
    >>> batch = jax.device_put((x, 2 * x), jax.NamedSharding(mesh, P("data")))
    >>> losses = []
    >>> for _ in range(5):
    ...   params, opt_state, loss = jit_train_step(params, opt_state, batch)
    ...   losses.append(float(loss))
    >>> losses[-1] < losses[0], int(exdyna_jax.get_stats(opt_state).step[0])
    (True, 5)
  """
  axis_name = axis_name if isinstance(axis_name, str) else _mesh_axes.data_axes(axis_name)
  workers = _mesh_axes.num_workers(mesh, axis_name)
  if workers == 1:
    warnings.warn(
        f"data_parallel over one worker: the mesh's {axis_name!r} axis has 1 device "
        f"(jax.devices(): {len(jax.devices())}), so nothing is exchanged and the sparsifier "
        "only delays the gradient. On a CPU machine, ask for devices before JAX starts: "
        "jax.config.update('jax_num_cpu_devices', 8); on GPUs, check that jax.devices() "
        "lists them all.",
        UserWarning,
        stacklevel=2,
    )
  per_worker = P(axis_name)
  shard = functools.partial(per_worker_map, mesh, axis_name)

  def init(params):
    _mesh_axes.refuse_axes_it_does_not_split(tx, params, mesh, axis_name)
    params = place_params(params, mesh, axis_name)
    # keep_unused: a state of constants (dense's) still takes its devices from the params.
    opt_state = jax.jit(shard(lambda p: add_worker_axis(tx.init(p)), P(), per_worker),
                        keep_unused=True)(params)
    _dp_checks.refuse_unexchanged_leaves(params, opt_state)
    _dp_checks.warn_if_not_first(opt_state, params)
    _dp_checks.warn_if_moments_after(opt_state)
    _dp_checks.check_multi_steps(opt_state)
    return opt_state

  def update(worker_grads, opt_state, params=None, **extra_args):
    if _local_steps.find(opt_state) is not None:
      raise TypeError(
          "dp.update cannot step local_steps: its gradients are taken at each worker's own "
          "parameters, which dp.value_and_grad does not see. Decorate a per-worker step "
          "with dp.step instead.")
    _dp_checks.check_worker_grads(worker_grads, params, workers)
    _dp_checks.check_worker_axis(opt_state, workers)
    return sharded_update(worker_grads, opt_state, params, extra_args)

  @jax.jit  # one program, not shard_map's op-by-op dispatch, where called eagerly
  def sharded_update(worker_grads, opt_state, params, extra_args):
    def body(grads, state, params, extra_args):
      updates, state = tx.update(
          drop_worker_axis(grads), drop_worker_axis(state), params, **extra_args
      )
      return updates, add_worker_axis(state)

    return shard(body, (per_worker, per_worker, P(), P()), (P(), per_worker))(
        worker_grads, opt_state, params, extra_args
    )

  def value_and_grad(loss_fn):
    def grad_fn(params, batch, *args):
      _dp_checks.check_batch(batch, workers)

      def body(params, batch, *args):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch, *args)
        return jax.lax.pmean(loss, axis_name), add_worker_axis(grads)

      in_specs = (P(), per_worker) + (P(),) * len(args)
      return jax.jit(shard(body, in_specs, (P(), per_worker)))(params, batch, *args)

    return grad_fn

  step = functools.partial(step_decorator, mesh, axis_name)

  def stats(opt_state):
    stats = first_worker(_stats.get_stats(opt_state), mesh)
    return _per_shard.summed_over_shards(stats) if stats.num_workers.ndim else stats

  return DataParallel(init, step, update, value_and_grad, stats, tx, mesh, axis_name)


def shardings_of(params: Any) -> tuple:
  """``(treedef, shardings)`` of placed parameters: hashable, to key a compiled step."""
  leaves, treedef = jax.tree.flatten(params)
  return treedef, tuple(None if isinstance(leaf, jax.core.Tracer) else leaf.sharding
                        for leaf in leaves)  # None: a traced or abstract leaf's is XLA's


def place_params(params: Any, mesh: jax.sharding.Mesh, axis_name: str | tuple[str, ...]) -> Any:
  """The parameters on ``mesh``: replicated over the data axes, other shardings kept.

  A leaf sharded over the mesh's other axes (tensor parallel,
  ``P(None, "model")``) keeps its sharding; any other leaf is replicated.
  Refuses what the step cannot run: a leaf sharded over a data axis (FSDP).
  """
  _dp_checks.refuse_unsupported_shardings(params, mesh, _mesh_axes.data_axes(axis_name))
  replicated = jax.NamedSharding(mesh, P())
  keep = lambda x: isinstance(x, jax.ShapeDtypeStruct) or (  # noqa: E731
      isinstance(getattr(x, "sharding", None), jax.NamedSharding) and x.sharding.mesh == mesh)
  return jax.tree.map(lambda x: x if keep(x) else jax.device_put(x, replicated), params)


def require_data_parallel(dp: Any, call: str) -> None:
  """Raises unless ``dp`` is a `DataParallel` (the Flax helpers take it first)."""
  if not isinstance(dp, DataParallel):
    raise TypeError(
        f"{call} takes what exdyna_jax.data_parallel(tx, mesh) returns first, got "
        f"{type(dp).__name__}."
    )


def step_decorator(mesh: jax.sharding.Mesh, axis_name: str | tuple[str, ...],
                   per_worker_step: Callable[..., tuple], *, own_params: bool = True
                   ) -> Callable[..., tuple]:
  """`DataParallel.step`: the jitted, donating train step of ``per_worker_step``.

  It checks the batch and the keyword arguments, places the inputs as the
  step takes them, runs the step per worker with the optimizer state's
  worker axis dropped, and after the first call refuses replicated params
  whose copies differ across the workers.

  Under `local_steps` (``own_params``) the step takes each worker's own
  parameters from the state and the synced ones leave it; the Flax helpers,
  whose first argument holds more than the parameters, pass False and
  swap the parameters themselves.
  """
  per_worker, shard = P(axis_name), functools.partial(per_worker_map, mesh, axis_name)
  workers = _mesh_axes.num_workers(mesh, axis_name)
  replicated, split = jax.NamedSharding(mesh, P()), jax.NamedSharding(mesh, per_worker)

  def body(params, opt_state, batch, *args):
    opt_state = drop_worker_axis(opt_state)
    worker_params = _local_steps.worker_params(opt_state, params) if own_params else params
    outputs = per_worker_step(worker_params, opt_state, batch, *args)
    _dp_checks.check_step_outputs(outputs, params, opt_state, per_worker_step)
    params, opt_state, *aux = outputs
    if own_params:
      params = _local_steps.synced_params(opt_state, params)
    return add_worker_axis(opt_state), params, add_worker_axis(jax.tree.map(jnp.asarray, aux))

  @functools.cache
  def state_first(num_args: int, param_shardings: tuple) -> Callable[..., tuple]:
    """The jitted, donating ``body`` for ``num_args`` arguments after the batch.

    The state leaves first: a donated state buffer is aliased to the first
    output of its shape, so nothing else may come before it. The parameters
    leave with the shardings they came with (``(treedef, leaves)``), which
    XLA would otherwise choose over the mesh's other axes.
    """
    in_specs = (P(), per_worker, per_worker) + (P(),) * num_args
    return jax.jit(shard(body, in_specs, (per_worker, P(), per_worker)), donate_argnums=(0, 1),
                   out_shardings=(None, jax.tree.unflatten(*param_shardings), None))

  checked = []  # the params' copies are compared after the first call
  waits = _mesh_axes.waits_for_each_step(mesh)
  counts = _mesh_axes.worker_counts(mesh, axis_name)  # what a state may record
  returned = []  # a weak reference to the first leaf of the state the last call returned
  differs = jax.jit(shard(functools.partial(
      jax.tree.map, lambda x: _dp_checks.differs_across(x, axis_name)), P(), P()))

  @functools.wraps(per_worker_step)
  def train_step(params, opt_state, batch, *args, **kwargs):
    if kwargs:
      raise TypeError(
          f"The train step of data_parallel(...).step takes its arguments by position "
          f"(params, opt_state, batch, *args), got keyword(s) {sorted(kwargs)}: pass them "
          "positionally, or close over constants in the step."
      )
    _dp_checks.check_batch(batch, workers)
    _dp_checks.check_worker_axis(opt_state, workers)
    _dp_checks.refuse_misfit_state(opt_state, counts, axis_name, last_returned=returned)
    # Placed as the step takes them (no copy if so): an Explicit mesh accepts nothing else.
    params = place_params(params, mesh, axis_name)
    batch, args = jax.device_put((batch, args), (split, replicated))
    opt_state, params, aux = state_first(len(args), shardings_of(params))(
        params, opt_state, batch, *args)
    returned[:] = _dp_checks.weak_first_leaf(opt_state)
    outputs = (params, opt_state, *aux)
    if any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(params)):
      return outputs  # under a jit of the user's: nothing to read or wait for
    if not checked:
      _dp_checks.refuse_per_worker_params(differs(params))
      checked.append(True)
    return jax.block_until_ready(outputs) if waits else outputs

  def lower(params, opt_state, batch, *args):  # e.g. to read the compiled program's collectives
    params = place_params(params, mesh, axis_name)
    put = lambda x, sharding: (  # noqa: E731  (abstract leaves pass: their sharding is XLA's)
        x if isinstance(x, jax.ShapeDtypeStruct) else jax.device_put(x, sharding))
    batch = jax.tree.map(lambda x: put(x, split), batch)
    args = jax.tree.map(lambda x: put(x, replicated), args)
    return state_first(len(args), shardings_of(params)).lower(params, opt_state, batch, *args)

  train_step.lower = lower
  return train_step
