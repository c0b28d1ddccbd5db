"""The flat view of a gradient pytree that every sparsifier works on.

Leaves are taken in ``jax.tree.leaves`` order, flattened and concatenated with
no gaps (as ``jax.flatten_util.ravel_pytree`` does), so element ``i`` of the
flat vector is the same coordinate on every worker and in the reference
implementation. Accumulation happens in float32 whatever the leaf dtype.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import P

ACCUMULATION_DTYPE = jnp.float32
MAX_ELEMENTS = 2**31 - 1  # indices are int32


class FlatLayout(NamedTuple):
  """Static description of a pytree as one flat vector.

  Attributes:
    treedef: the tree structure.
    shapes: shape of every leaf, in leaf order.
    dtypes: dtype of every leaf, in leaf order.
    num_elements: total number of elements ``N``.
  """

  treedef: Any
  shapes: tuple[tuple[int, ...], ...]
  dtypes: tuple[Any, ...]
  num_elements: int

  @property
  def sizes(self) -> tuple[int, ...]:
    return tuple(math.prod(shape) for shape in self.shapes)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class LeavesSeen:
  """Which leaves of the params tree a sparsifier's ``init`` saw: static, no arrays.

  ``optax.masked`` (and ``optax.multi_transform``) hand the transforms they
  wrap ``optax.MaskedNode`` where a leaf is kept from them. Every method's
  state holds one (``leaves_seen``), so that `data_parallel` can name the
  leaves no sparsifier sees.

  Attributes:
    seen: for each leaf of the params tree, in flat order, whether it
      reached the sparsifier.
  """

  seen: tuple[bool, ...]


def leaves_seen(params: Any) -> LeavesSeen:
  """The `LeavesSeen` of the params tree an ``init`` was given."""
  is_masked = lambda node: isinstance(node, optax.MaskedNode)  # noqa: E731
  return LeavesSeen(tuple(not is_masked(leaf)
                          for leaf in jax.tree.leaves(params, is_leaf=is_masked)))


def layout_of(tree: Any, *, what: str = "params") -> FlatLayout:
  """Describes ``tree`` as a flat vector, rejecting what cannot be sparsified.

  Args:
    tree: a pytree of arrays (concrete or traced).
    what: how to call the tree in error messages.

  Returns:
    The tree's `FlatLayout`.

  Raises:
    TypeError: if a leaf is not a floating-point array.
    ValueError: if the tree is empty or has ``2**31`` elements or more.
  """
  leaves, treedef = jax.tree.flatten(tree)
  if not leaves:
    raise ValueError(f"The {what} tree has no array leaves; there is nothing to sparsify.")
  shapes, dtypes = [], []
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    dtype = jnp.result_type(leaf)
    if not jnp.issubdtype(dtype, jnp.floating):
      raise TypeError(
          f"Leaf {jax.tree_util.keystr(path)} of the {what} tree has dtype {dtype}; "
          "gradient sparsifiers need floating-point leaves. Differentiate only the "
          "float parameters (e.g. filter integer state out with optax.masked or "
          "keep it outside the optimized tree)."
      )
    shapes.append(tuple(np.shape(leaf)))
    dtypes.append(dtype)
  num_elements = sum(math.prod(shape) for shape in shapes)
  if num_elements == 0:
    raise ValueError(
        f"The {what} tree has leaves but no elements (shapes {tuple(shapes)}); there is "
        "nothing to sparsify. Leave empty parameters out of the optimized tree."
    )
  if num_elements > MAX_ELEMENTS:
    raise ValueError(
        f"The {what} tree has {num_elements} elements; int32 indices limit a "
        f"sparsifier to {MAX_ELEMENTS}. Split the model into several optimizer "
        "groups (optax.multi_transform)."
    )
  return FlatLayout(treedef, tuple(shapes), tuple(dtypes), num_elements)


def fingerprint(tree: Any) -> tuple[int, str]:
  """Which leaf is where in the flat vector: a nonzero int32 hash, and what it hashes.

  The residual is one flat vector in the order of ``tree``'s leaves, so a
  state stays right only for a tree with the same leaves, paths and shapes
  in the same order. Dtypes do not enter (a cast moves nothing).

  Args:
    tree: a pytree of arrays (concrete or traced).

  Returns:
    ``(fingerprint, leaves)``: the hash in ``[1, 2**31 - 1]``, and the
    leaves as ``"path (shape), ..."`` in flat order, for messages.
  """
  leaves = ", ".join(f"{jax.tree_util.keystr(path)} {tuple(np.shape(leaf))}"
                     for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0])
  return zlib.crc32(leaves.encode()) % (2**31 - 1) + 1, leaves


def check_same_layout(expected: FlatLayout, got: FlatLayout, *, what: str) -> None:
  """Raises a ValueError naming the difference between two layouts."""
  if expected.treedef != got.treedef:
    raise ValueError(
        f"The {what} tree has structure {got.treedef}, but the optimizer state was "
        f"initialized for {expected.treedef}. Call init() with the same tree you "
        "pass to update()."
    )
  if expected.shapes != got.shapes:
    raise ValueError(
        f"The {what} leaf shapes {got.shapes} differ from the shapes the optimizer "
        f"state was initialized for, {expected.shapes}. Call init() with the same "
        "tree you pass to update()."
    )


def gradient_layout(updates: Any, params: Any, num_elements: int | None) -> FlatLayout:
  """Layout of the gradient passed to ``update()``, checked against the state.

  Args:
    updates: the gradient tree.
    params: the params tree passed to ``update()``, or None.
    num_elements: ``N`` the optimizer state was initialized for, or None when
      the state does not record it.

  Returns:
    The gradient's `FlatLayout`.

  Raises:
    ValueError: if the gradient and params layouts differ, or the gradient
      does not have the state's number of elements.
  """
  layout = layout_of(updates, what="gradient")
  if params is not None:
    check_same_layout(layout_of(params, what="params"), layout, what="gradient")
  if num_elements is not None and num_elements != layout.num_elements:
    raise ValueError(
        f"The gradient has {layout.num_elements} elements but the optimizer state "
        f"was initialized for {num_elements}. Call init() with the same tree you "
        "pass to update()."
    )
  return layout


def gathered(tree: Any) -> Any:
  """``tree`` with each leaf sharded over an Explicit mesh axis replicated over it.

  A leaf typed ``f32[16,32@model]`` has no flat ``[512]`` sharding to take, so
  the flat vector is formed from its gathered copy (what XLA does for an
  Auto axis too). Leaves with no Explicit sharding pass unchanged: no
  operation is added.
  """
  return jax.tree.map(lambda leaf: jax.sharding.reshard(leaf, P()) if is_sharded(leaf) else leaf,
                      tree)


def resharded_like(tree: Any, template: Any) -> Any:
  """``tree`` with each leaf given the Explicit sharding of ``template``'s leaf (a local slice)."""
  return jax.tree.map(
      lambda leaf, like: jax.sharding.reshard(leaf, jax.typeof(like).sharding.spec)
      if is_sharded(like) else leaf, tree, template)


def is_sharded(leaf: Any) -> bool:
  """Whether ``leaf``'s type names a mesh axis (an Explicit one: Auto axes are not typed)."""
  spec = getattr(jax.typeof(leaf).sharding, "spec", ())
  return any(entry is not None for entry in spec)


def flatten(tree: Any) -> jax.Array:
  """Concatenates the leaves of ``tree`` into one float32 vector."""
  leaves = jax.tree.leaves(tree)
  return jnp.concatenate([jnp.ravel(leaf).astype(ACCUMULATION_DTYPE) for leaf in leaves])


def narrow_dtypes(layout: FlatLayout) -> list[str]:
  """The leaves' dtypes narrower than float32 (bfloat16, float16), sorted; static."""
  return sorted({str(d) for d in layout.dtypes if jnp.finfo(d).bits < 32})


def as_leaf_dtypes(indices: jax.Array, values: jax.Array, layout: FlatLayout) -> jax.Array:
  """float32 ``values`` at flat ``indices`` as the leaves' own dtypes will hold them.

  Where a leaf is narrower than float32 (bfloat16, float16), the value is
  clipped to the dtype's finite range (65,504 for float16), rounded to it and
  back; elsewhere it is unchanged. Indices past ``N`` are
  left as they are (nothing is written there).

  Args:
    indices: int32 ``[M]`` flat indices.
    values: float32 ``[M]``.
    layout: the `FlatLayout` the indices refer to.

  Returns:
    float32 ``[M]``.
  """
  narrow = narrow_dtypes(layout)
  if not narrow:
    return values
  leaf_ends = np.cumsum(layout.sizes)
  # Per leaf (plus one entry for indices past N): 0 keeps float32, i + 1 rounds to narrow[i].
  codes = [narrow.index(str(d)) + 1 if str(d) in narrow else 0 for d in layout.dtypes]
  leaf = jnp.searchsorted(leaf_ends, indices, side="right", method="scan_unrolled")
  code = jnp.asarray([*codes, 0], jnp.int32)[leaf]
  rounded = values
  for i, dtype in enumerate(narrow, start=1):
    limit = float(jnp.finfo(dtype).max)
    held = jnp.clip(values, -limit, limit).astype(dtype).astype(values.dtype)
    rounded = jnp.where(code == i, held, rounded)
  return rounded


def unflatten(flat: jax.Array, layout: FlatLayout) -> Any:
  """Inverse of `flatten`: slices ``flat`` back into leaves of the layout's dtypes."""
  leaves = []
  offset = 0
  for shape, dtype, size in zip(layout.shapes, layout.dtypes, layout.sizes, strict=True):
    leaves.append(flat[offset : offset + size].reshape(shape).astype(dtype))
    offset += size
  return jax.tree.unflatten(layout.treedef, leaves)
