"""Runs a sparsifier over simulated workers: the way users call it, in tests.

``run_vmap`` simulates ``n`` workers on one device with
``jax.vmap(axis_name=...)``; ``run_shard_map`` and ``run_pmap`` use ``n`` real
(forced CPU) devices. All take per-worker gradients stacked as
``[n, steps, ...]`` leaves and return per-worker updates ``[n, steps, ...]``,
the per-step states stacked the same way, and the final state.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
from jax import P

import exdyna_jax

AXIS = "data"
# Every registered method that sparsifies (takes a density): all but dense.
SPARSIFYING = tuple(name for name in exdyna_jax.available_sparsifiers() if name != "dense")
# Runs of more element-steps than this (workers x steps x elements) execute
# for longer than they compile: they get XLA's optimizing code generation,
# where the suite's default (conftest) is the cheapest to compile.
LONG_RUN = 10_000_000
RUN_OPTIMIZED = {"xla_backend_optimization_level": 1}


def compiler_options(element_steps: int) -> dict | None:
  """`RUN_OPTIMIZED` for a run of more than `LONG_RUN` element-steps, else the suite's defaults."""
  return RUN_OPTIMIZED if element_steps > LONG_RUN else None


def _scan_steps(tx, params):
  """Per-worker function: init, then one update per step."""

  def per_worker(grads):
    state = tx.init(params)

    def step(state, grads_t):
      updates, state = tx.update(grads_t, state, params)
      return state, (updates, state)

    final, (updates, states) = jax.lax.scan(step, state, grads)
    return updates, states, final

  return per_worker


def num_workers_of(grads) -> int:
  return jax.tree.leaves(grads)[0].shape[0]


def run_vmap(tx: optax.GradientTransformation, params, grads):
  n = num_workers_of(grads)
  mapped = jax.vmap(_scan_steps(tx, params), axis_name=AXIS, axis_size=n)
  element_steps = sum(np.size(leaf) for leaf in jax.tree.leaves(grads))
  return jax.jit(mapped, compiler_options=compiler_options(element_steps))(grads)


def run_pmap(tx: optax.GradientTransformation, params, grads):
  return jax.pmap(_scan_steps(tx, params), axis_name=AXIS)(grads)


def mesh_of(n: int) -> jax.sharding.Mesh:
  return jax.make_mesh(
      (n,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:n]
  )


def run_shard_map(tx: optax.GradientTransformation, params, grads, *, check_vma: bool = False):
  """Each device gets one worker's gradients; outputs keep a leading worker axis."""
  n = num_workers_of(grads)
  per_worker = _scan_steps(tx, params)

  def body(grads):
    out = per_worker(jax.tree.map(lambda g: g[0], grads))
    return jax.tree.map(lambda x: x[None], out)

  fn = jax.shard_map(
      body, mesh=mesh_of(n), in_specs=P(AXIS), out_specs=P(AXIS), check_vma=check_vma
  )
  return jax.jit(fn)(grads)


def equations(jaxpr):
  """Every equation of ``jaxpr`` (a ``make_jaxpr(...).jaxpr``) and of the programs in it."""
  for eqn in jaxpr.eqns:
    yield eqn
    for param in eqn.params.values():
      for inner in param if isinstance(param, tuple) else (param,):
        if hasattr(inner, "eqns") or hasattr(inner, "jaxpr"):
          yield from equations(getattr(inner, "jaxpr", inner))


def to_numpy(tree):
  return jax.tree.map(np.asarray, tree)


def unflatten_like(flat: np.ndarray, template) -> object:
  """``[..., N]`` -> a tree shaped like ``template`` with leaves ``[..., *leaf_shape]``.

  Leaves are cut in ``jax.tree`` order (dict keys sorted), as the library flattens.
  """
  leaves, treedef = jax.tree.flatten(template)
  lead = flat.shape[:-1]
  pieces, offset = [], 0
  for leaf in leaves:
    size = int(np.prod(np.shape(leaf)))
    pieces.append(flat[..., offset : offset + size].reshape(lead + np.shape(leaf)))
    offset += size
  assert offset == flat.shape[-1]
  return jax.tree.unflatten(treedef, pieces)


def all_equations(jaxpr, platform):
  """The equations of ``jaxpr`` and of every jaxpr inside them, depth first; of a
  ``lax.platform_dependent`` conditional, only the branch ``platform`` runs."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "platform_index":
      continue
    branches_platforms = eqn.params.get("branches_platforms")
    if branches_platforms:
      default = branches_platforms.index(None)
      chosen = next((i for i, names in enumerate(branches_platforms)
                     if names and platform in names), default)
      yield from all_equations(eqn.params["branches"][chosen].jaxpr, platform)
      continue
    yield eqn
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          yield from all_equations(inner, platform)
