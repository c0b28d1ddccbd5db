"""Hierarchical sparsification: dense inside a node, sparse between nodes.

On a 2-D mesh such as ``("node", "local")`` -- several multi-GPU hosts, fast
links (NVLink, PCIe) between the ``L`` devices of a host and a slower network
between hosts -- the gradient is first reduced densely over the fast axis,
and only the result is sparsified across the slow axis. Two ways to do it:

* ``fast_reduce="scatter"`` (the default): a reduce-scatter over the fast
  axis leaves local device ``l`` with slice ``l`` (``ceil(N / L)``
  elements) of the node-mean gradient; the wrapped sparsifier runs on that
  slice across the slow axis, with its own residual, threshold and
  partitions; an all-gather over the fast axis reassembles the dense update.
  A node's slow-network traffic is that of *one* worker of the method, split
  over its ``L`` devices.
* ``fast_reduce="psum"``: an all-reduce over the fast axis gives every
  device of a node the whole node-mean gradient, and every device runs the
  same sparsifier on it: a node behaves exactly as one worker of the wrapped
  method, but each of its ``L`` devices repeats the node's slow-network
  exchange (``L`` times the bytes, identical content).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import optax

from exdyna_jax.core import _collectives, _layout

FAST_REDUCE_MODES = ("scatter", "psum")


def _fast_axis_size(fast_axis: str) -> int:
  return _collectives.axis_size(
      fast_axis,
      unbound_message=f"The fast axis {fast_axis!r} is not bound. hierarchical() runs per "
      "device inside jax.shard_map over a 2-D mesh, e.g. jax.make_mesh((nodes, local), "
      f"('node', {fast_axis!r})), or inside nested jax.vmap(axis_name=...); pass "
      "fast_axis= to match your mesh.",
  )


def slice_size(num_elements: int, num_local: int) -> int:
  """Elements of the slice each of ``num_local`` devices sparsifies in scatter mode.

  Args:
    num_elements: ``N``, elements of the whole gradient.
    num_local: ``L``, devices on the fast axis.

  Returns:
    ``ceil(N / L)``: the gradient is padded with zeros to ``L`` such slices.
  """
  return math.ceil(num_elements / num_local)


def _refuse_varying_types(fast_axis: str) -> None:
  """Scatter mode cannot run under ``shard_map(check_vma=True)``; says what to do."""
  if _collectives.tracks_varying(fast_axis):
    raise ValueError(
        "hierarchical(fast_reduce='scatter') runs the sparsifier on a slice that differs "
        f"between the devices of a node (it varies over {fast_axis!r} as well as the slow "
        "axis), which the sparsifiers' varying-type bookkeeping under "
        "jax.shard_map(check_vma=True) does not support. Use "
        "jax.shard_map(..., check_vma=False) (the usual way to keep gradients local), or "
        "hierarchical(..., fast_reduce='psum')."
    )


def _slice_context(error: ValueError, num_elements: int, num_local: int) -> ValueError:
  return ValueError(
      f"{error} (hierarchical(fast_reduce='scatter') gives the sparsifier of each of the "
      f"{num_local} devices on the fast axis a slice of ceil({num_elements} / "
      f"{num_local}) = {slice_size(num_elements, num_local)} elements; size the method's "
      "options for the slice, or pass fast_reduce='psum' to sparsify the whole gradient "
      "on every device.)"
  )


def hierarchical(
    sparsifier: optax.GradientTransformation,
    *,
    fast_axis: str = "local",
    fast_reduce: str = "scatter",
) -> optax.GradientTransformationExtraArgs:
  """Reduces gradients densely over ``fast_axis``, then runs ``sparsifier`` across nodes.

  Build the sparsifier over the *slow* axis and wrap it::

    mesh = jax.make_mesh((num_hosts, devices_per_host), ("node", "local"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    tx = optax.chain(
        exdyna_jax.hierarchical(exdyna_jax.exdyna(0.001, axis_name="node")),
        optax.sgd(0.1, momentum=0.9),
    )
    # inside jax.shard_map(..., mesh=mesh), batch sharded P(("node", "local")):
    updates, opt_state = tx.update(local_grads, opt_state, params)

  With ``L`` devices on ``fast_axis`` and ``N`` gradient elements:

  ``fast_reduce="scatter"`` (default): the leaves are flattened into one
  float32 vector, zero-padded to ``L * S`` with ``S = ceil(N / L)``, and
  ``psum_scatter``-ed over ``fast_axis`` (then divided by ``L``), so local
  device ``l`` holds elements ``[l*S, (l+1)*S)`` of the node-mean gradient.
  ``sparsifier`` runs on that slice across the slow axis: local rank ``l`` of
  every node forms one group with its own residual (``S`` elements),
  threshold, partitions and density ``d`` of the slice. The slices' dense
  updates are ``all_gather``-ed over ``fast_axis`` and cut back into the
  params' tree, shapes and dtypes; every device of the mesh gets the same
  update. Per step, a node's devices send over the slow network the bytes of
  *one* worker of the method in total (each ``1/L`` of them), and the
  sparsifier's compute and residual memory per device are ``1/L`` of the
  whole gradient's.

  ``fast_reduce="psum"``: ``pmean(grads, fast_axis)`` (summed in float32,
  returned in each leaf's dtype; one dense all-reduce inside each node), then
  ``sparsifier`` on the whole node-mean gradient. Every device of a node
  holds the same residual and update, so a node is exactly one worker of the
  wrapped method; but each of the ``L`` devices repeats the node's exchange,
  ``L`` times the slow-network bytes (identical content).

  Scatter is the default because it costs the same on the fast links (a
  ring reduce-scatter plus an all-gather move what one all-reduce moves) and
  ``L`` times less on the slow network, in sparsifier compute and in
  residual memory; with ``L`` = 4 to 8 GPUs per host that is the difference
  hierarchical sparsification exists for. Choose ``"psum"`` to reproduce a
  method per node exactly (one threshold and one global selection per node,
  as the published algorithms run with one worker per node, and the same
  stats on every device); when a slice of ``N / L`` elements is too small for
  the method's options (e.g. ExDyna needs ``N / L >= 32 * num_blocks``); or
  under ``jax.shard_map(check_vma=True)``, which scatter mode refuses (the
  slices vary over the fast axis, beyond what the sparsifiers' varying types
  track; ``check_vma=False`` is the usual way to keep gradients local anyway).

  The state is the sparsifier's own, so ``exdyna_jax.get_stats`` reads it
  unchanged. Its ``bytes_sent`` counts the slow axis only (the sparsifier sees
  ``n = axis_size(slow axis)`` workers); the fast-axis collectives add
  ``2 (L-1)/L * 4N`` bytes on the fast links in either mode. In scatter mode
  the residual has ``S`` elements and the stats describe each device's slice:
  ``threshold``, ``selected``, ``transmitted``, ``workloads`` and the
  partitions differ between the devices of a node (they are equal along the
  slow axis; ``bytes_sent`` is the same everywhere). A non-finite gradient
  element in any slice makes every slice skip the step (a NaN is passed to
  the sparsifiers of the other slices), so ``stats.nonfinite > 0`` and
  ``skipped_steps`` agree on every device, while the ``nonfinite`` counts
  differ. Works with every method of
  `exdyna_jax.available_sparsifiers`, in both modes.

  The calling convention is that of the wrapped sparsifier: ``init`` and
  ``update`` run per device, inside a context that binds both axes, on the
  device's local, unreduced gradient, first in an ``optax.chain``.

  Example:
    Two nodes of two devices, simulated with nested ``jax.vmap``; Top-k keeps
    one element in each device's slice of four:

    >>> import jax, jax.numpy as jnp, exdyna_jax
    >>> tx = exdyna_jax.hierarchical(exdyna_jax.topk(0.25, axis_name="node"))
    >>> params = {"w": jnp.zeros(8)}
    >>> grads = {"w": jnp.array([[[4., 0, 0, 0, 0, 0, 2, 0], [0, 0, 0, 0, 0, 0, 2, 1]],
    ...                          [[0., 0, 0, 0, 0, 0, 3, 0], [0, 0, 2, 0, 0, 0, 0, 1]]])}
    >>> def device(g):
    ...   return tx.update(g, tx.init(params), params)
    >>> step = jax.jit(jax.vmap(jax.vmap(device, axis_name="local"), axis_name="node"))
    >>> updates, state = step(grads)
    >>> updates["w"][0, 0].tolist()  # the same on all four devices
    [1.0, 0.0, 0.5, 0.0, 0.0, 0.0, 1.75, 0.0]
    >>> state.residual.shape  # [node, local, slice]: a residual per slice
    (2, 2, 4)
    >>> exdyna_jax.get_stats(state).transmitted.tolist()  # [node][local]: per slice
    [[2, 1], [2, 1]]

  Args:
    sparsifier: a sparsifier built with ``axis_name`` set to the slow axis
      (e.g. ``"node"``); it must not be ``fast_axis``.
    fast_axis: the mesh axis of the fast links, reduced densely.
    fast_reduce: ``"scatter"`` (reduce-scatter, sparsify a slice per device,
      all-gather) or ``"psum"`` (all-reduce, every device sparsifies the
      whole node mean).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is the
    sparsifier's state (for the slice, in scatter mode).

  Raises:
    TypeError: if ``sparsifier`` is not one of this package's sparsifiers
      (another transform, a chain, a ``hierarchical``): the devices of a node
      would apply different updates.
    ValueError: for an empty ``fast_axis`` or an unknown ``fast_reduce``.
  """
  if not isinstance(fast_axis, str) or not fast_axis:
    raise ValueError(f"fast_axis must be a mesh axis name, got {fast_axis!r}.")
  if fast_reduce not in FAST_REDUCE_MODES:
    raise ValueError(
        f"fast_reduce must be one of {FAST_REDUCE_MODES}, got {fast_reduce!r}."
    )
  slow_axis = sparsifier.axis_name if isinstance(sparsifier, _collectives.Sparsifier) else None
  if slow_axis is None:
    raise TypeError(
        "hierarchical wraps one of this package's sparsifiers itself (exdyna_jax.exdyna, "
        f"topk, ..., dense), got {type(sparsifier).__name__} {sparsifier!r:.80}: another "
        "transform, a chain, or a hierarchical(...) already. Put other transforms after "
        "it: optax.chain(hierarchical(exdyna_jax.exdyna(0.001, axis_name='node'), "
        "fast_axis='local'), optax.sgd(0.1)); one hierarchical covers both levels."
    )
  if slow_axis == fast_axis:
    raise ValueError(
        f"The sparsifier exchanges over {fast_axis!r}, the fast axis: its selections would "
        "stay inside each node and the nodes would drift apart. Build it over the slow "
        "axis, e.g. hierarchical(exdyna_jax.exdyna(0.001, axis_name='node'), "
        f"fast_axis={fast_axis!r})."
    )
  if fast_reduce == "psum":
    return _psum_mode(sparsifier, fast_axis)
  return _scatter_mode(sparsifier, fast_axis)


def _psum_mode(
    sparsifier: optax.GradientTransformation, fast_axis: str
) -> optax.GradientTransformationExtraArgs:
  def init_fn(params: Any):
    _fast_axis_size(fast_axis)
    return sparsifier.init(params)

  def update_fn(updates, state, params=None, **extra_args):
    size = _fast_axis_size(fast_axis)
    total = jax.lax.psum(
        jax.tree.map(lambda g: g.astype(_layout.ACCUMULATION_DTYPE), updates), fast_axis
    )
    mean = jax.tree.map(lambda s: s / size, total)  # float32: nothing rounded away yet
    update, state = sparsifier.update(mean, state, params, **extra_args)
    layout = _layout.layout_of(updates, what="gradient")
    if not _layout.narrow_dtypes(layout):  # static: nothing to round
      return jax.tree.map(lambda u, g: u.astype(g.dtype), update, updates), state
    flat, state = keep_what_rounding_loses(_layout.flatten(update), state, layout, 0)
    return _layout.unflatten(flat, layout), state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def keep_what_rounding_loses(update: jax.Array, state: Any, layout: _layout.FlatLayout,
                             first_index: jax.Array | int) -> tuple[jax.Array, Any]:
  """A float32 update of elements ``first_index, ...`` rounded to their leaves' dtypes,
  the loss kept in the residual.

  The sparsifier runs on float32 node means (the whole vector, or a slice of
  it), so it cannot round to the bfloat16 or float16 leaves they come from,
  as the flat mode does (`_feedback.keep_what_rounding_loses`): here each
  node keeps ``update - rounded`` in its residual, and nothing is lost. A
  state with no residual (``dense()``) rounds as the flat mode does.
  """
  indices = first_index + jnp.arange(update.shape[0], dtype=jnp.int32)
  rounded = _layout.as_leaf_dtypes(indices, update, layout)
  if rounded is update or "residual" not in getattr(state, "_fields", ()):
    return rounded, state
  return rounded, state._replace(residual=state.residual + (update - rounded))


def _scatter_mode(
    sparsifier: optax.GradientTransformation, fast_axis: str
) -> optax.GradientTransformationExtraArgs:
  def init_fn(params: Any):
    num_local = _fast_axis_size(fast_axis)
    layout = _layout.layout_of(params, what="params")
    size = slice_size(layout.num_elements, num_local)
    try:
      state = sparsifier.init(jnp.zeros((size,), _layout.ACCUMULATION_DTYPE))
    except _collectives.UnboundAxisError:
      raise
    except ValueError as error:
      raise _slice_context(error, layout.num_elements, num_local) from error
    return state

  def update_fn(updates, state, params=None, **extra_args):
    num_local = _fast_axis_size(fast_axis)
    _refuse_varying_types(fast_axis)
    layout = _layout.gradient_layout(updates, params, None)
    size = slice_size(layout.num_elements, num_local)
    flat = _layout.flatten(updates)
    flat = jnp.pad(flat, (0, num_local * size - layout.num_elements))
    mean = jax.lax.psum_scatter(flat, fast_axis, scatter_dimension=0, tiled=True) / num_local
    # Each slice's sparsifier screens only its slice (across nodes). If any
    # slice of this node is non-finite, a NaN in all of them makes every
    # slice's sparsifier skip the step, on every node: no partial updates.
    bad = jax.lax.psum(jnp.any(~jnp.isfinite(mean)).astype(jnp.int32), fast_axis) > 0
    mean = mean.at[0].set(jnp.where(bad, jnp.nan, mean[0]))
    try:
      update, state = sparsifier.update(mean, state, None, **extra_args)
    except _collectives.UnboundAxisError:
      raise
    except ValueError as error:
      raise _slice_context(error, layout.num_elements, num_local) from error
    update, state = keep_what_rounding_loses(
        update, state, layout, jax.lax.axis_index(fast_axis) * size)
    if _collectives.is_manual(fast_axis):
      full = jax.lax.all_gather(update, fast_axis, tiled=True, to="invarying")
    else:  # vmap(axis_name=...) has no invariant all_gather
      full = jax.lax.all_gather(update, fast_axis, tiled=True)
    return _layout.unflatten(full[: layout.num_elements], layout), state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
