"""The Pallas kernels against the loops on the device (``benchmarks.gpu --check``).

`check_passes` runs the two passes over a range both ways on one worker's
gradient; `check_kernels` runs ExDyna, its reference rule and MiCRO for
`CHECK_STEPS` steps of the 8 workers both ways and compares every state and
update, the indices sent and the thresholds.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

from benchmarks._gpu_programs import vmapped_update
from benchmarks._gpu_timing import WORKERS, traced_as
from exdyna_jax.selection import _selection

CHECK_STEPS = 4


def check_kernels(num_elements, density, grads):
  """The kernels against the loops on this device.

  ``passes``: whether `_selection.count_in_range` and `select_in_range` give
  the same counts, largest magnitude, indices and pass count on worker 0's
  gradient for a few ranges. Per method, `CHECK_STEPS` steps of the
  8 workers: ``bit_for_bit`` (every state and update the same),
  ``transmitted_equal`` (the indices sent each step) and the largest
  relative difference of the thresholds.
  """
  result = {"passes": check_passes(grads[0])}
  for name in ("exdyna", "exdyna_reference", "micro"):
    runs = []
    for loops in (False, True):
      with traced_as("_loops" if loops else name):
        state, run = vmapped_update(name, num_elements, density)
        steps = []
        for step in range(CHECK_STEPS):
          state, update = run(state, grads * (1.0 + 0.1 * step))
          steps.append(jax.device_get((state, update)))  # the next step donates the state
        runs.append(steps)
    kernels, loops = runs
    pairs = [(a.stats, b.stats) for (a, _), (b, _) in zip(kernels, loops, strict=True)]
    result[name] = {
        "bit_for_bit": trees_equal(kernels, loops),
        "transmitted_equal": all((a.transmitted == b.transmitted).all() for a, b in pairs),
        "threshold_max_relative_difference": max(
            float(abs(a.threshold[0] - b.threshold[0]) / b.threshold[0]) for a, b in pairs),
    }
    print(f"{name}: kernels against loops: {result[name]}", file=sys.stderr, flush=True)
  return result


def trees_equal(a, b):
  """Whether two trees of arrays are the same, bit for bit."""
  return all(jax.tree.leaves(jax.tree.map(lambda x, y: bool((x == y).all()), a, b)))


def check_passes(accumulated):
  """Whether the kernels' passes over a range give the loops' results on ``accumulated``."""
  num_elements = accumulated.shape[0]
  chunk = _selection.chunk_length(num_elements, WORKERS)
  scale = float(jnp.max(jnp.abs(accumulated)))
  thresholds = scale * jnp.linspace(0.5, 0.9, 27, dtype=jnp.float32)

  def passes(begin, end):
    counts = _selection.count_in_range(accumulated, begin, end, thresholds, chunk=chunk)
    selection = _selection.select_in_range(
        accumulated, thresholds[0], begin, end, capacity=4096, chunk=chunk, fallback_offset=0)
    return counts, selection

  ranges = [(0, num_elements), (num_elements // 7, num_elements // 2),
            (num_elements - num_elements // 50, num_elements)]
  same = True
  for begin, end in ranges:
    results = []
    for name in ("kernels", "_loops"):
      with traced_as(name):
        results.append(jax.device_get(jax.jit(passes)(jnp.int32(begin), jnp.int32(end))))
    same &= trees_equal(*results)
  return bool(same)
