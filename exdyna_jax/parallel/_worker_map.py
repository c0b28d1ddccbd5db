"""The per-worker map: ``jax.shard_map`` manual over the data axes, gradients kept local.

The mesh's other axes (a ``model`` axis) stay XLA's to partition, so
parameters sharded over them stay so, and the model's own code runs as under
``jax.jit``. ``check_vma=False``: gradients stay local (no implicit psum of
the gradient of replicated params), and the sparsifier's output, identical on
every worker by construction, may leave through a replicated out_spec.

Where those axes are Explicit, JAX 0.10.2 (Shardy) lowers such a map with an
all-gather over them of every operand and result typed over them, and a
slice back: the parameters, the gradient and each leaf of the per-shard
state would cross the boundary whole. `explicit_inside` enters the map with
those axes Auto (as ``jax.sharding.auto_axes`` does), where the boundary
moves nothing, and makes them Explicit again inside with the shardings the
arguments came with: the per-worker step sees the types it would see without
the map (``f32[16,32@model]``), and the shell sparsifies the shards each
device holds. The results leave with the shardings the step gave them, the
data axes added where ``out_specs`` name them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax import P

from exdyna_jax.parallel import _mesh_axes
from exdyna_jax.shell._per_shard import axes_named, spec_of


def per_worker_map(mesh: jax.sharding.Mesh, axis_name: str | tuple[str, ...], fn: Callable,
                   in_specs: Any, out_specs: Any) -> Callable:
  """``jax.shard_map`` of the per-worker ``fn``, manual over the data axes ``axis_name``."""
  data_axes = _mesh_axes.data_axes(axis_name)
  if explicit_axes_besides(mesh, data_axes):
    return explicit_inside(fn, mesh, data_axes, in_specs, out_specs)
  return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False,
                       axis_names=frozenset(data_axes))


def explicit_axes_besides(mesh: jax.sharding.Mesh, data_axes: tuple[str, ...]) -> tuple[str, ...]:
  """The mesh's Explicit axes other than the data axes."""
  return tuple(name for name, kind in zip(mesh.axis_names, mesh.axis_types, strict=True)
               if kind == jax.sharding.AxisType.Explicit and name not in data_axes)


def _entry(names: tuple[str, ...]) -> Any:
  """The partition spec's entry that names ``names``."""
  return names[0] if len(names) == 1 else (names or None)


def without(spec: P, axes: tuple[str, ...]) -> P:
  """``spec`` with the mesh axes ``axes`` taken out of every entry."""
  return P(*(_entry(tuple(name for name in axes_named(entry) if name not in axes))
             for entry in spec))


def joined(outer: P, inner: P, ndim: int) -> P:
  """The spec of a result whose dimension ``i`` is split over ``outer[i]``, then ``inner[i]``."""
  padded = lambda spec: (*spec, *(None,) * (ndim - len(spec)))  # noqa: E731
  return P(*(_entry(axes_named(o) + axes_named(i))
             for o, i in zip(padded(outer), padded(inner), strict=True)))


def explicit_inside(fn: Callable, mesh: jax.sharding.Mesh, data_axes: tuple[str, ...],
                    in_specs: Any, out_specs: Any) -> Callable:
  """``jax.shard_map(fn, ...)`` manual over ``data_axes``, the mesh's Explicit axes kept.

  Args:
    fn: the per-worker function.
    mesh: a mesh with Explicit axes besides ``data_axes``.
    data_axes: the axes the map is manual over.
    in_specs: ``shard_map``'s, over ``data_axes`` only.
    out_specs: ``shard_map``'s, over ``data_axes`` only.

  Returns:
    The mapped function: arguments and results typed over the Explicit axes.
  """
  explicit = explicit_axes_besides(mesh, data_axes)
  auto_mesh = mesh.abstract_mesh.update_axis_types(
      {name: jax.sharding.AxisType.Auto for name in explicit})
  untyped = tuple(name for name in data_axes  # not Explicit: a type may not name them
                  if mesh.axis_types[mesh.axis_names.index(name)] != jax.sharding.AxisType.Explicit)

  def mapped(*args):
    inner_specs = jax.tree.map(lambda x: without(spec_of(x), data_axes), args)
    result_specs = []  # the results' specs over the Explicit axes, found when fn is traced

    def body(*args):
      results = fn(*args)
      result_specs.append(jax.tree.map(spec_of, results))
      return results

    inner = jax.sharding.explicit_axes(body, axes=explicit, in_sharding=inner_specs)
    with jax.sharding.use_abstract_mesh(auto_mesh):
      args = jax.sharding.reshard(args, jax.tree.map(lambda x: without(spec_of(x), explicit), args))
      results = jax.shard_map(inner, mesh=auto_mesh, in_specs=in_specs, out_specs=out_specs,
                              axis_names=frozenset(data_axes), check_vma=False)(*args)
    outer = jax.tree.broadcast(out_specs, results, is_leaf=lambda x: isinstance(x, P))
    specs = jax.tree.map(lambda o, i, r: joined(without(o, untyped), i, r.ndim),
                         outer, result_specs[-1], results, is_leaf=lambda x: isinstance(x, P))
    return jax.sharding.reshard(results, jax.tree.map(lambda s: jax.NamedSharding(mesh, s), specs))

  return mapped
