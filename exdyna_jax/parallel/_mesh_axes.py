"""The data axes of a mesh, checked against the axes the optimizer exchanges over.

`data_parallel` splits the batch and the optimizer state over one mesh axis,
or a tuple of them (``("node", "local")`` for a `hierarchical` sparsifier),
and replicates both over the others. On a mesh of several axes it traces
``tx.init`` abstractly with chosen axes bound: every sparsifier's ``init``
reads the size of each axis it exchanges over, so what it finds unbound says
which axes the optimizer needs. `waits_for_each_step` says whether a step on
a mesh blocks.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import jax
import optax

from exdyna_jax.core import _collectives


def data_axes(axis_name: str | Sequence[str]) -> tuple[str, ...]:
  """``axis_name`` as a tuple of mesh axis names."""
  return (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)


def num_workers(mesh: jax.sharding.Mesh, axis_name: str | tuple[str, ...]) -> int:
  """Devices along the data-parallel axis or axes of ``mesh``: the workers.

  Raises:
    ValueError: for an axis the mesh does not have, or one named twice.
  """
  axes = data_axes(axis_name)
  if not axes or len(set(axes)) < len(axes) or any(a not in mesh.axis_names for a in axes):
    raise ValueError(
        f"The mesh has axes {mesh.axis_names}, not {axis_name!r}; pass axis_name= naming "
        "its data-parallel axis, or a tuple of distinct ones."
    )
  return math.prod(mesh.shape[axis] for axis in axes)


def worker_counts(mesh: jax.sharding.Mesh, axis_name: str | tuple[str, ...]) -> list[int]:
  """The numbers of workers a sparsifier in the step may exchange among, smallest first: each
  group of the data axes (a `hierarchical` one exchanges over the slow axis of a tuple)."""
  axes = data_axes(axis_name)
  groups = (group for size in range(1, len(axes) + 1)
            for group in itertools.combinations(axes, size))
  return sorted({math.prod(mesh.shape[axis] for axis in group) for group in groups})


def axis_init_needs(tx: optax.GradientTransformation, params: Any, mesh: jax.sharding.Mesh,
                    bound: tuple[str, ...]) -> _collectives.UnboundAxisError | None:
  """What ``tx.init`` raises when only the mesh axes ``bound`` are bound, or None.

  Every sparsifier's ``init`` reads the size of each axis it exchanges over;
  the trace is abstract (``jax.eval_shape``).
  """
  init = tx.init
  for axis in reversed(bound):
    init = jax.vmap(init, in_axes=None, axis_name=axis, axis_size=mesh.shape[axis])
  try:
    jax.eval_shape(init, params)
  except _collectives.UnboundAxisError as error:
    return error
  return None


def refuse_axes_it_does_not_split(tx: optax.GradientTransformation, params: Any,
                                  mesh: jax.sharding.Mesh, axis_name: str | tuple[str, ...]
                                  ) -> None:
  """Raises unless ``tx`` exchanges over the data axes exactly, on a mesh of several axes.

  An axis ``tx`` needs beyond them (a `hierarchical` sparsifier's fast axis)
  would still be bound inside ``shard_map``, its devices repeating each
  other's batch with different states labelled replicated; a data axis it
  never exchanges over leaves the workers along it training apart.
  """
  axes = data_axes(axis_name)
  others = tuple(a for a in mesh.axis_names if a not in axes and mesh.shape[a] > 1)
  split = tuple(a for a in axes if mesh.shape[a] > 1)
  if not others and len(split) < 2:  # one axis: data_parallel.init's leaf check covers it
    return
  unbound = axis_init_needs(tx, params, mesh, axes)
  if unbound is not None and unbound.axis_name not in mesh.axis_names:
    raise unbound  # its message: match the sparsifier's axis_name to the mesh
  if unbound is not None:
    raise ValueError(
        f"data_parallel(axis_name={axis_name!r}) splits the batch and the optimizer state "
        f"over {axis_name!r} only and replicates them over {others}, but the optimizer "
        f"communicates over {unbound.axis_name!r} too: its devices would repeat each "
        "other's batch and hold different states labelled replicated. Name every axis the "
        f"workers span, e.g. data_parallel(tx, mesh, axis_name={axes + others!r}) for a "
        "hierarchical(...) sparsifier."
    )
  for axis in split:
    if axis_init_needs(tx, params, mesh, tuple(a for a in axes if a != axis)) is None:
      raise ValueError(
          f"The optimizer never exchanges over {axis!r}, one of the data axes {axes}: the "
          f"workers along it would train apart. Wrap the sparsifier in hierarchical(..., "
          f"fast_axis={axis!r}), or leave {axis!r} out of axis_name."
      )


def waits_for_each_step(mesh: jax.sharding.Mesh) -> bool:
  """Whether the decorated steps on ``mesh`` wait for their results.

  They do on a mesh of several CPU devices: when a process queues steps
  ahead of its CPU devices, XLA:CPU's collectives can deadlock, or abort the
  process after 40 s in their rendezvous (:doc:`/multihost`, section 6), so
  a step there blocks until its outputs are ready, as a loop that reads its
  loss every step would.
  """
  return mesh.size > 1 and mesh.devices.flat[0].platform == "cpu"
