"""Every method's run on the accelerator against the same run on the CPU (for `benchmarks.gpu`).

The two platforms trace different code for the same maths: on a GPU the
passes over a partition are Pallas kernels, the leaves are concatenated
into ``a = g + m`` and the guard counts the bad elements; on the CPU they
are XLA loops, leaf-by-leaf adds and a sum (`jax.lax.platform_dependent`).
`against_cpu` runs each registered method for a few steps of 8 workers
under ``vmap`` on the same gradients on both, and reports whether the
indices sent each step are the same and how far the updates and the
residuals are apart.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

import exdyna_jax
from benchmarks import _common
from benchmarks._gpu_timing import AXIS, WORKERS

STEPS = 4
SHAPES = {"w": (384, 512), "b": (512,), "v": (4096,)}  # a few leaves, N = 201,216
METHODS = (*exdyna_jax.available_sparsifiers(), "exdyna_reference")


def run(name, density, grads, device):
  """``STEPS`` steps of ``name`` on ``device``: each step's ``(update, state)``, on the host."""
  extra = {"controller": "reference"} if name == "exdyna_reference" else {}
  tx = _common.make_tx(name.removesuffix("_reference"), density, WORKERS, **extra)
  params = jax.tree.map(lambda g: jnp.zeros(g.shape[1:], g.dtype), grads)
  step = jax.jit(jax.vmap(lambda g, s: tx.update(g, s, params), axis_name=AXIS,
                          axis_size=WORKERS))
  grads = jax.device_put(grads, device)
  state = jax.jit(jax.vmap(lambda _: tx.init(params), axis_name=AXIS, axis_size=WORKERS))(
      jax.device_put(jnp.arange(WORKERS), device))
  steps = []
  for number in range(STEPS):
    update, state = step(jax.tree.map(lambda g, number=number: g * (1.0 + 0.1 * number), grads),
                         state)
    steps.append(jax.device_get((update, state)))
  return steps


def relative_difference(a, b):
  """``max |a - b| / max |b|`` over the leaves of two trees of float arrays."""
  floats = [(np.asarray(x, np.float64), np.asarray(y, np.float64))
            for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
            if np.issubdtype(np.asarray(y).dtype, np.floating)]
  scale = max((np.abs(y).max(initial=0.0) for _, y in floats), default=0.0) or 1.0
  return max((np.abs(x - y).max(initial=0.0) for x, y in floats), default=0.0) / scale


def against_cpu(density, methods=METHODS):
  """Per method: ``transmitted_equal`` (each step's indices sent, every worker),
  and the largest relative differences of the updates and of the states."""
  keys = jax.random.split(jax.random.key(7), len(SHAPES))
  grads = {name: jax.random.normal(key, (WORKERS, *shape), jnp.float32)
           for key, (name, shape) in zip(keys, SHAPES.items(), strict=True)}
  grads = jax.device_get(grads)
  accelerator, cpu = jax.devices()[0], jax.devices("cpu")[0]
  result = {"elements": sum(int(np.prod(s)) for s in SHAPES.values()), "density": density,
            "steps": STEPS, "accelerator": accelerator.platform}
  for name in methods:
    there, here = run(name, density, grads, accelerator), run(name, density, grads, cpu)
    sent = [(exdyna_jax.get_stats(a[1]).transmitted, exdyna_jax.get_stats(b[1]).transmitted)
            for a, b in zip(there, here, strict=True)]
    result[name] = {
        "transmitted_equal": all(np.array_equal(a, b) for a, b in sent),
        "update_relative_difference": max(
            relative_difference(a[0], b[0]) for a, b in zip(there, here, strict=True)),
        "state_relative_difference": max(
            relative_difference(a[1], b[1]) for a, b in zip(there, here, strict=True)),
    }
    print(f"{name} on {accelerator.platform} against cpu: {result[name]}", file=sys.stderr,
          flush=True)
  return result
