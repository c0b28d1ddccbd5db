"""How `benchmarks.gpu` times a jitted step, and the variants of the library it traces.

A step is timed blocked on each call and queued (`timed_steps`). A method's
name may end in ``_loops`` (the passes over the partition traced as XLA
loops, as before the Pallas kernels), ``_unguarded`` (a diagnostic: the
guard patched out, its screen's sum and ``psum`` kept: no conditional, no
select) or ``_unchecked`` (a diagnostic: the check of a state that does not
fit patched out, the rest of the guard kept), which `traced_as` applies
while the step is traced.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from unittest import mock

import jax
import jax.numpy as jnp

from benchmarks import _common
from exdyna_jax.selection import _range_kernels
from exdyna_jax.shell import _guard

AXIS = "data"
WORKERS = 8


def timed_steps(step, carry, repeats):
  """Runs ``carry = step(carry)`` 3 times to compile and warm up, then ``repeats``
  times blocked on each, then ``repeats`` times queued (one block at the end).

  Returns:
    ``(carry, times, queued, returned)``: the last carry, the seconds of each
    blocked step (what a loop that reads every step's result gets: the
    host's dispatch and the wait included), the mean seconds of a queued one
    (the device's throughput, where the host can run ahead) and the seconds
    until each blocked call returned (`_common.timed_calls`).
  """
  for _ in range(3):
    carry = step(carry)
  carry, returned, times = _common.timed_calls(step, jax.block_until_ready(carry), repeats)
  start = time.perf_counter()
  for _ in range(repeats):
    carry = step(carry)
  carry = jax.block_until_ready(carry)
  return carry, times, (time.perf_counter() - start) / repeats, returned


def timing(times, queued, per=1, returned=None):
  """The JSON of `timed_steps`' times, each divided by ``per``; with ``returned``, its
  median as ``dispatch_seconds``."""
  result = {"seconds": statistics.median(times) / per, "min_seconds": min(times) / per,
            "queued_seconds": queued / per}
  if returned is None:
    return result
  return {**result, "dispatch_seconds": statistics.median(returned) / per}


def traced_as(name):
  """The context a method ``name`` is traced in: the passes over the partition as XLA
  loops for ``*_loops`` names, the guard patched out for ``*_unguarded`` ones
  (`unguarded_screen`), the check of a state that does not fit patched out for
  ``*_unchecked`` ones (its conditional and host callback: the screen and the
  selects stay), the library as it is otherwise."""
  if name.endswith("_unchecked"):
    return mock.patch.object(_guard, "stop_if_misfit", lambda *_, **__: jnp.int32(0))
  if name.endswith("_unguarded"):
    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(_guard, "screen", unguarded_screen))
    stack.enter_context(mock.patch.object(
        _guard, "skip_if_nonfinite", lambda screened, step, args, *_, **__: step(*args)))
    return stack
  if not name.endswith("_loops"):
    return contextlib.nullcontext()
  return mock.patch.object(_range_kernels, "KERNEL_PLATFORMS", ())


def unguarded_screen(values, stats, num_workers, axis_name, *, layout=0, leaves=""):
  """A sum over the values and its ``psum``, as `_guard.screen`'s on a CPU, without its
  conditional count or the check of a state that does not fit (a diagnostic)."""
  del stats, num_workers, leaves
  total = sum(jnp.sum(leaf, dtype=jnp.float32) for leaf in jax.tree.leaves(values))
  tripped = jax.lax.psum((~jnp.isfinite(total)).astype(jnp.int32), axis_name)
  return _guard.Screen(tripped, jnp.bool_(False), jnp.int32(layout), jnp.int32(0), jnp.int32(0))


def method_of(name):
  """The registered method a benchmark name runs (``exdyna_loops`` runs ``exdyna``)."""
  return name.removesuffix("_loops").removesuffix("_unguarded").removesuffix("_unchecked")
