"""Hierarchical sparsification: dense inside a node, sparse between nodes.

On a 2-D mesh such as ``("node", "local")`` -- several multi-GPU hosts, fast
links (NVLink, PCIe) between the devices of a host and a slower network
between hosts -- the gradient is first averaged densely over the fast axis,
and only the result is sparsified across the slow axis. Every device of a
node then holds the same node-mean gradient, the same residual and the same
update, so a node behaves as one worker of the wrapped sparsifier: the
sparse index and value traffic crosses the slow network only, and its
volume is that of ``n_nodes`` workers, not ``n_nodes * n_local``.
"""

from __future__ import annotations

from typing import Any

import jax
import optax

from exdyna_jax import _layout


def _fast_axis_size(fast_axis: str) -> int:
  try:
    return jax.lax.axis_size(fast_axis)
  except NameError:
    raise ValueError(
        f"The fast axis {fast_axis!r} is not bound. hierarchical() runs per device "
        "inside jax.shard_map over a 2-D mesh, e.g. jax.make_mesh((nodes, local), "
        f"('node', {fast_axis!r})), or inside nested jax.vmap(axis_name=...); pass "
        "fast_axis= to match your mesh."
    ) from None


def hierarchical(
    sparsifier: optax.GradientTransformation, *, fast_axis: str = "local"
) -> optax.GradientTransformationExtraArgs:
  """Averages gradients densely over ``fast_axis``, then runs ``sparsifier``.

  Build the sparsifier over the *slow* axis and wrap it::

    mesh = jax.make_mesh((num_hosts, devices_per_host), ("node", "local"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    tx = optax.chain(
        exdyna_jax.hierarchical(exdyna_jax.exdyna(0.001, axis_name="node")),
        optax.sgd(0.1, momentum=0.9),
    )
    # inside jax.shard_map(..., mesh=mesh), batch sharded P(("node", "local")):
    updates, opt_state = tx.update(local_grads, opt_state, params)

  ``update`` computes ``pmean(grads, fast_axis)`` (summed in float32, returned
  in each leaf's dtype; one dense all-reduce over the devices of a node) and
  passes it to ``sparsifier.update``. The state is the sparsifier's own, so
  ``exdyna_jax.get_stats`` reads it unchanged; its ``bytes_sent`` counts the
  slow axis only (the sparsifier sees ``n = axis_size(slow axis)`` workers).
  Works with every method of `exdyna_jax.available_sparsifiers`.

  The calling convention is that of the wrapped sparsifier: ``init`` and
  ``update`` run per device, inside a context that binds both axes, on the
  device's local, unreduced gradient, first in an ``optax.chain``.

  Args:
    sparsifier: a sparsifier built with ``axis_name`` set to the slow axis
      (e.g. ``"node"``); it must not be ``fast_axis``.
    fast_axis: the mesh axis of the fast links, reduced densely.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is the
    sparsifier's state.
  """
  if not isinstance(fast_axis, str) or not fast_axis:
    raise ValueError(f"fast_axis must be a mesh axis name, got {fast_axis!r}.")

  def init_fn(params: Any):
    _fast_axis_size(fast_axis)
    return sparsifier.init(params)

  def update_fn(updates, state, params=None, **extra_args):
    size = _fast_axis_size(fast_axis)
    total = jax.lax.psum(
        jax.tree.map(lambda g: g.astype(_layout.ACCUMULATION_DTYPE), updates), fast_axis
    )
    mean = jax.tree.map(lambda s, g: (s / size).astype(g.dtype), total, updates)
    return sparsifier.update(mean, state, params, **extra_args)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
