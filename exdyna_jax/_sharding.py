"""Using a sparsifier from plain ``jax.jit`` with ``NamedSharding`` (pjit style).

A sparsifier needs each worker's *local* gradient, and its state (the
residual above all) differs from worker to worker. Under plain ``jax.jit`` the
gradient of a loss over a sharded batch is the global one, already summed by
a dense all-reduce that XLA inserts, and there is no notion of a worker.
`data_parallel` hides the ``jax.shard_map`` that restores both: per-worker
gradients come out stacked along a leading axis sharded over the mesh axis,
and every leaf of the optimizer state gets the same leading axis, so no
partition spec is ever written by hand.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import optax
from jax import P


def add_worker_axis(tree):
  """Adds a leading worker axis of size 1 to every leaf (per-worker state out of shard_map)."""
  return jax.tree.map(lambda x: x[None], tree)


def drop_worker_axis(tree):
  """Drops the leading worker axis of every leaf (per-worker state into shard_map)."""
  return jax.tree.map(lambda x: x[0], tree)


class DataParallel(NamedTuple):
  """An optimizer and a gradient function for data parallelism under ``jax.jit``.

  Attributes:
    init: ``params -> opt_state``; every state leaf has a leading axis of size
      ``n`` sharded over the mesh axis (one slice per worker).
    update: ``(worker_grads, opt_state, params) -> (updates, opt_state)``;
      ``worker_grads`` leaves have the leading worker axis (as
      ``value_and_grad`` returns them); ``updates`` are replicated and shaped
      like ``params``.
    value_and_grad: ``loss_fn -> f``, with ``f(params, batch, *args) ->
      (mean loss, worker_grads)``: each worker differentiates ``loss_fn`` on
      its own shard of ``batch`` (leading axis sharded over the mesh axis), and
      no gradient is all-reduced.

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
    ('init', 'update', 'value_and_grad')
  """

  init: Callable[[Any], Any]
  update: Callable[..., tuple[Any, Any]]
  value_and_grad: Callable[[Callable[..., jax.Array]], Callable[..., tuple[jax.Array, Any]]]


def data_parallel(
    tx: optax.GradientTransformation, mesh: jax.sharding.Mesh, *, axis_name: str = "data"
) -> DataParallel:
  """Wraps an optimizer whose first stage is a sparsifier for pjit-style training.

  Args:
    tx: the optimizer, e.g. ``optax.chain(exdyna_jax.exdyna(...), ...)``.
    mesh: a mesh with an axis called ``axis_name`` (other axes replicate).
    axis_name: the data-parallel mesh axis.

  Returns:
    A `DataParallel` of ``init``, ``update`` and ``value_and_grad``.

  Raises:
    ValueError: if ``mesh`` has no axis ``axis_name``.

  Example:
    A linear model trained on the 8 forced CPU devices, with the batch
    sharded over ``"data"`` and no ``shard_map`` in user code:

    >>> import jax, jax.numpy as jnp, optax, exdyna_jax
    >>> from jax import P
    >>> mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    >>> dp = exdyna_jax.data_parallel(
    ...     optax.chain(exdyna_jax.exdyna(0.01, num_blocks=32), optax.sgd(0.1)), mesh)
    >>> def loss_fn(params, batch):
    ...   x, y = batch
    ...   return jnp.mean((x @ params["w"] - y) ** 2)
    >>> replicated = jax.NamedSharding(mesh, P())  # as train_step returns them: no recompile
    >>> params = jax.device_put({"w": jnp.zeros((64, 64))}, replicated)
    >>> opt_state = dp.init(params)
    >>> residual = optax.tree.get(opt_state, "residual")  # one per worker
    >>> residual.shape, residual.sharding.spec == P("data")
    ((8, 4096), True)
    >>> @jax.jit
    ... def train_step(params, opt_state, batch):  # batch sharded P("data")
    ...   loss, grads = dp.value_and_grad(loss_fn)(params, batch)
    ...   updates, opt_state = dp.update(grads, opt_state, params)
    ...   return optax.apply_updates(params, updates), opt_state, loss
    >>> x = jax.random.normal(jax.random.key(0), (32, 64))
    >>> batch = jax.device_put((x, 2 * x), jax.NamedSharding(mesh, P("data")))
    >>> losses = []
    >>> for _ in range(5):
    ...   params, opt_state, loss = train_step(params, opt_state, batch)
    ...   losses.append(float(loss))
    >>> losses[-1] < losses[0], int(exdyna_jax.get_stats(opt_state).step[0])
    (True, 5)
  """
  if axis_name not in mesh.axis_names:
    raise ValueError(
        f"The mesh has axes {mesh.axis_names}, not {axis_name!r}; pass "
        "axis_name= naming its data-parallel axis."
    )
  per_worker = P(axis_name)

  def shard(fn, in_specs, out_specs):
    # check_vma=False: gradients stay local (no implicit psum of the gradient
    # of replicated params), and the sparsifier's output, identical on every
    # worker by construction, may leave through a replicated out_spec.
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)

  def init(params):
    return shard(lambda p: add_worker_axis(tx.init(p)), P(), per_worker)(params)

  def update(worker_grads, opt_state, params=None, **extra_args):
    def body(grads, state, params):
      updates, state = tx.update(
          drop_worker_axis(grads), drop_worker_axis(state), params, **extra_args
      )
      return updates, add_worker_axis(state)

    return shard(body, (per_worker, per_worker, P()), (P(), per_worker))(
        worker_grads, opt_state, params
    )

  def value_and_grad(loss_fn):
    def grad_fn(params, batch, *args):
      def body(params, batch, *args):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch, *args)
        return jax.lax.pmean(loss, axis_name), add_worker_axis(grads)

      in_specs = (P(), per_worker) + (P(),) * len(args)
      return shard(body, in_specs, (P(), per_worker))(params, batch, *args)

    return grad_fn

  return DataParallel(init, update, value_and_grad)
