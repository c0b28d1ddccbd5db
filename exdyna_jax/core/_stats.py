"""Per-step statistics every sparsifier keeps in its optimizer state."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

INT32_MAX = 2**31 - 1
WORD = 2**31  # a running total is two int32 words: high * WORD + low
TOTALS = ("transmitted_total", "overflow_total", "bytes_total", "target_total")


def add_to_total(words: jax.Array, count: jax.Array | int) -> jax.Array:
  """``words + count``, carried into the high word.

  ``count`` is a nonnegative int32, or a static Python int of any size (a
  step's bytes past ``2**31``): its multiples of ``WORD`` go to the high word.
  """
  high_count, count = divmod(count, WORD) if isinstance(count, int) else (0, count)
  low = words[..., 1].astype(jnp.uint32) + jnp.asarray(count, jnp.int32).astype(jnp.uint32)
  high = words[..., 0] + (low >> 31).astype(jnp.int32) + high_count
  return jnp.stack([high, (low & (WORD - 1)).astype(jnp.int32)], axis=-1)


class SparsifierStats(NamedTuple):
  """What the last step did, identical on every worker.

  Read it from any chained optimizer state with one line::

    stats = optax.tree.get(opt_state, "stats")

  Attributes:
    step: int32 number of completed steps.
    threshold: float32 threshold used at the last step (before the first
      step: the one the first step will use).
    selected: int32 a diagnostic: elements that passed the threshold on all
      workers together, before the capacity limit (1 for a worker that sent
      only its fallback index). What was sent is ``transmitted``.
    transmitted: int32 distinct indices actually exchanged: the density sent
      is ``transmitted / N``, and ``transmitted / k`` is 1 when a method sends
      what was asked for.
    overflow: int32 elements that passed but were not exchanged (they did not
      fit the static buffers or the shared slots); they stay in the residual. Equals
      ``selected - transmitted`` where the workers' selections are disjoint
      (ExDyna, MiCRO).
    workloads: int32 ``[n]`` elements that passed in each partition (or on
      each worker, for methods without partitions), before the capacity
      limit.
    imbalance: float32 ``max(workloads) / mean(workloads)``.
    partition_starts: int32 ``[n]`` first block of each partition at the last
      step (0 for methods without partitions).
    partition_sizes: int32 ``[n]`` blocks in each partition at the last step
      (elements for MiCRO; ``N`` elements for methods without partitions:
      every worker scans the whole vector).
    bytes_sent: int32 bytes this worker sent in the last step's collectives,
      as ring algorithms move them (static: the buffers have fixed size),
      control counts included; it equals what the compiled program's
      collectives move (see `exdyna_jax.hlo`). It saturates at
      ``2**31 - 1``: a step that moves more (a dense all-reduce of 307M
      float32 parameters or more on 8 workers) reads ``2**31 - 1``;
      ``bytes_total`` counts it exactly.
    nonfinite: int32 NaN or infinite elements in the last step's gradients
      ``g``, summed over all workers. When it is nonzero every
      worker skipped that step: the update was zero and every other field,
      the residual included, kept its value from the step before. (The
      screen's ``psum`` of two int32 behind it, on a CPU a skipped step's
      count too, and a skipped step's exchange, which runs and is dropped,
      are counted in ``bytes_sent``.)
    skipped_steps: int32 steps skipped so far because of non-finite
      gradients (they are not counted in ``step``).
    num_workers: int32 the number of workers the state was initialized for.
      A step on another number stops with an error that names
      `exdyna_jax.resize_workers`; it catches a worker axis a restore cut or
      padded to fit (orbax's ``strict=False``), which the shapes cannot show.
    transmitted_total: ``transmitted`` summed over the completed steps.
    overflow_total: ``overflow`` summed over the completed steps.
    bytes_total: ``bytes_sent`` summed over every step, skipped ones included.
      The totals (``target_total`` below too) let a run's density be read
      with no sync per step (`read_totals`). Each is exact past the range
      of int32: an int32 pair ``[..., 2]``, ``(high, low)``, worth
      ``high * 2**31 + low`` (JAX computes in 32 bits unless x64 is on, and a
      dense run's bytes pass ``2**31`` within a few steps).
    target: int32 ``k``, the indices the last step was asked to transmit
      (its density level's with a schedule; ``N`` for a dense step; SparDL's
      ``n k_b`` pairs, ``k_b = max(1, floor(d ceil(N / n)))`` per block; 0 before
      the first step, and for ``hard_threshold(threshold=...)``, which has
      no ``k``): ``transmitted / target`` is what was sent against what was
      asked for.
    target_total: ``target`` summed over the completed steps: the ``k``
      the run asked for in all, so ``transmitted_total / target_total`` is
      its sent/k, a density warm-up's levels included.
    layout: int32 fingerprint of the gradient tree's leaves (paths and
      shapes, in the flat order the residual follows), set by every step of
      a method with a residual; 0 before the first (``init()`` sees only
      ``N``: the first step lays the residual out), and for ``dense()``. A
      step on a tree laid out otherwise (leaves renamed, reordered, added or
      removed since a checkpoint, or another tree passed to ``update()``)
      stops with an error that lists the leaves, instead of adding each
      residual to another leaf.

  Example:
    The stats of a freshly initialized ExDyna state, on 8 workers simulated
    with ``jax.vmap`` (``N = 4096``, ``k = 40``, 32 blocks):

    >>> import jax, jax.numpy as jnp, optax, exdyna_jax
    >>> tx = optax.chain(exdyna_jax.exdyna(density=0.01, num_blocks=32), optax.sgd(0.1))
    >>> init = jax.vmap(tx.init, in_axes=None, axis_name="data", axis_size=8)
    >>> stats = optax.tree.get(init(jnp.zeros(4096)), "stats")
    >>> stats.workloads.shape  # [worker, partition]: the state has a worker axis
    (8, 8)
    >>> print(stats.partition_starts[0])  # 8 partitions of 4 blocks at the start
    [ 0  4  8 12 16 20 24 28]
    >>> int(stats.step[0]), round(float(stats.threshold[0]), 4)  # 1 / (2 sqrt(40))
    (0, 0.0791)
  """

  step: jax.Array
  threshold: jax.Array
  selected: jax.Array
  transmitted: jax.Array
  overflow: jax.Array
  workloads: jax.Array
  imbalance: jax.Array
  partition_starts: jax.Array
  partition_sizes: jax.Array
  bytes_sent: jax.Array
  # Owned by the guard every update runs through (`exdyna_jax.shell._guard.skip_if_nonfinite`):
  # a sparsification step need not set them.
  nonfinite: jax.Array = np.int32(0)
  skipped_steps: jax.Array = np.int32(0)
  num_workers: jax.Array = np.int32(0)
  transmitted_total: jax.Array = np.zeros(2, np.int32)
  overflow_total: jax.Array = np.zeros(2, np.int32)
  bytes_total: jax.Array = np.zeros(2, np.int32)
  # Set by every step (last, with a default: a pickled state of 0.1.0 loads with 0).
  target: jax.Array = np.int32(0)
  target_total: jax.Array = np.zeros(2, np.int32)  # the guard's
  layout: jax.Array = np.int32(0)  # the guard's


def is_sparsifier_state(node: Any) -> bool:
  """Whether ``node`` is a sparsifier's state: a ``NamedTuple`` holding `SparsifierStats`.

  Every method's state is one (a new method's too), so nothing lists them.
  """
  return isinstance(node, tuple) and isinstance(getattr(node, "stats", None), SparsifierStats)


def require_exchange(tx: optax.GradientTransformation, role: str
                     ) -> optax.GradientTransformationExtraArgs:
  """``tx``, whose ``init`` refuses a state with no sparsifier's in it.

  For the slots where one of this package's methods (``hierarchical(...)``
  included) must do the exchange: anything else there (``optax.sgd``) would
  let every worker train alone, with nothing to say so.

  Args:
    tx: what the user passed.
    role: the slot, for the message, e.g. ``"local_steps' compressor"``.

  Raises:
    TypeError: at ``init``, if the state holds no `SparsifierStats`.
  """
  tx = optax.with_extra_args_support(tx)

  def init_fn(params):
    state = tx.init(params)
    if not sparsifier_states(state):
      raise TypeError(
          f"{role} is {type(tx).__name__}, not one of this package's methods (exdyna_jax."
          "exdyna, topk, ..., dense, or hierarchical of one): nothing would be exchanged and "
          "every worker would train alone."
      )
    return state

  return optax.GradientTransformationExtraArgs(init_fn, tx.update)


def read_totals(stats: SparsifierStats) -> dict[str, int]:
  """The run so far, as Python ints, from stats with or without the worker axis.

  Args:
    stats: `SparsifierStats` (``dp.stats(opt_state)``, or `get_stats` of a
      state with the worker axis: every worker holds the same totals).

  Returns:
    ``{"steps", "skipped_steps", "transmitted", "overflow", "bytes_sent",
    "target"}``: completed and skipped steps, and the totals over them;
    ``transmitted / target`` is the run's sent/k.

  Example:
    >>> import jax, jax.numpy as jnp, exdyna_jax
    >>> tx = exdyna_jax.topk(0.01)  # each worker's 40 largest of N = 4096
    >>> def run(grads):  # three steps on each of 8 workers
    ...   state = tx.init(grads[0])
    ...   for g in grads:
    ...     _, state = tx.update(g, state)
    ...   return state
    >>> grads = jax.random.normal(jax.random.key(0), (8, 3, 4096))
    >>> totals = exdyna_jax.read_totals(jax.jit(jax.vmap(run, axis_name="data"))(grads).stats)
    >>> totals["steps"], totals["target"]  # k = 40 asked for at each step
    (3, 120)
    >>> 1 <= totals["transmitted"] / totals["target"] <= 8  # the union of the workers' 40
    True
  """
  total = lambda words: int(np.ravel(words)[0]) * WORD + int(np.ravel(words)[1])  # noqa: E731
  return {
      "steps": int(np.ravel(stats.step)[0]),
      "skipped_steps": int(np.ravel(stats.skipped_steps)[0]),
      "transmitted": total(stats.transmitted_total),
      "overflow": total(stats.overflow_total),
      "bytes_sent": total(stats.bytes_total),
      "target": total(stats.target_total),
  }


def initial_stats(
    threshold: float, partition_starts: jax.Array, partition_sizes: jax.Array
) -> SparsifierStats:
  """Statistics before the first step: every count zero."""
  zero = jnp.zeros((), jnp.int32)
  counts = ("step", "selected", "transmitted", "overflow", "bytes_sent", "target", "nonfinite",
            "skipped_steps")
  return SparsifierStats(
      threshold=jnp.asarray(threshold, jnp.float32),
      workloads=jnp.zeros(partition_sizes.shape, jnp.int32),
      imbalance=jnp.ones((), jnp.float32),
      partition_starts=jnp.asarray(partition_starts, jnp.int32),
      partition_sizes=jnp.asarray(partition_sizes, jnp.int32),
      num_workers=jnp.int32(len(partition_sizes)),
      **dict.fromkeys(TOTALS, jnp.zeros(2, jnp.int32)),
      **dict.fromkeys(counts, zero),
  )


def check_num_workers(stats: SparsifierStats, num_workers: int, axis_name: str) -> None:
  """Rejects a state initialized (or restored) for another number of workers.

  Every state keeps per-worker and per-partition arrays of length ``n`` (and
  each worker its own residual), so it cannot move to another ``n``. The
  check is static (shapes only): it costs nothing at run time.

  Args:
    stats: the state's `SparsifierStats`.
    num_workers: size of ``axis_name`` in the calling context.
    axis_name: the data-parallel axis, for the message.

  Raises:
    ValueError: if ``stats.workloads`` does not have length ``num_workers``.
  """
  shape = tuple(np.shape(stats.workloads))
  if shape == (num_workers,):
    return
  initialized_for = shape[0] if len(shape) == 1 else f"an unknown number of (shape {shape})"
  raise ValueError(
      f"The optimizer state was initialized for {initialized_for} workers but axis "
      f"{axis_name!r} has {num_workers}. A sparsifier's state is per worker (each "
      "worker's residual, and per-partition arrays of length n), so it cannot move to "
      "another number of workers as it is: restore the checkpoint onto its stored shapes "
      "and pass it through exdyna_jax.resize_workers(tx, state, params, num_workers), "
      "which keeps what the parameters are owed; or restore on a mesh of "
      f"{initialized_for} devices. Also call init() inside the same mapped context as "
      "update()."
  )


def whole_vector(num_workers: int, num_elements: int) -> tuple[jax.Array, jax.Array]:
  """Partition starts and sizes of a method without partitions: all of ``N`` each."""
  return (
      jnp.zeros((num_workers,), jnp.int32),
      jnp.full((num_workers,), num_elements, jnp.int32),
  )


def bytes_fields(stats: SparsifierStats, num_bytes: int) -> dict[str, jax.Array]:
  """A step's static ``num_bytes`` as the fields ``stats._replace`` takes.

  ``bytes_sent`` saturates at ``2**31 - 1``; ``bytes_total`` adds the exact
  count (the guard adds its own flags' bytes to both).
  """
  return {"bytes_sent": jnp.int32(min(num_bytes, INT32_MAX)),
          "bytes_total": add_to_total(stats.bytes_total, num_bytes)}


def add_bytes(num_bytes: jax.Array, more: jax.Array | int) -> jax.Array:
  """``num_bytes + more`` (both nonnegative int32), saturating at ``2**31 - 1``."""
  return jnp.where(num_bytes > INT32_MAX - more, INT32_MAX, num_bytes + more).astype(jnp.int32)


def unpartitioned_stats(
    previous: SparsifierStats,
    *,
    threshold: jax.Array,
    selected: jax.Array,
    transmitted: jax.Array,
    overflow: jax.Array,
    workloads: jax.Array,
    num_elements: int,
    bytes_sent: int,
    target: int,
) -> SparsifierStats:
  """Statistics of a step of a method without partitions.

  Args:
    previous: the stats before the step (the shell's guard advances their
      ``step`` and sets the fields it owns).
    threshold: float32 threshold used (or the effective one).
    selected: int32 elements selected by all workers together.
    transmitted: int32 distinct indices exchanged.
    overflow: int32 elements that passed but were not sent.
    workloads: int32 ``[n]`` elements selected by each worker.
    num_elements: ``N``.
    bytes_sent: static bytes one worker sent (`bytes_fields`).
    target: static ``k`` the step was asked to transmit.

  Returns:
    The `SparsifierStats`, with `whole_vector` partitions.
  """
  starts, sizes = whole_vector(workloads.shape[0], num_elements)
  return previous._replace(
      threshold=jnp.asarray(threshold, jnp.float32),
      selected=selected,
      transmitted=transmitted,
      overflow=overflow,
      workloads=workloads,
      imbalance=imbalance_of(workloads),
      partition_starts=starts,
      partition_sizes=sizes,
      **bytes_fields(previous, bytes_sent),
      target=jnp.int32(target),
  )


def imbalance_of(workloads: jax.Array) -> jax.Array:
  """``max / mean`` of the workloads (1 when all are zero)."""
  total = jnp.sum(workloads)
  mean = total.astype(jnp.float32) / workloads.shape[0]
  return jnp.where(total > 0, jnp.max(workloads) / jnp.maximum(mean, 1e-30), 1.0).astype(
      jnp.float32
  )


def sparsifier_states(tree: Any) -> list[Any]:
  """Every sparsifier's state in ``tree`` (an optimizer state, chained or wrapped)."""
  return [node for node in jax.tree.leaves(tree, is_leaf=is_sparsifier_state)
          if is_sparsifier_state(node)]


def get_stats(opt_state: Any) -> SparsifierStats:
  """Returns the `SparsifierStats` inside a (possibly chained) optimizer state.

  Equivalent to ``optax.tree.get(opt_state, "stats")``, but typed on any
  container: where the state was converted into mappings (the ``nnx.State``
  of a Flax ``nnx.Optimizer``, whose leaves are ``nnx`` variables), the
  stats are rebuilt as a `SparsifierStats` of arrays.

  Example:
    >>> import jax, jax.numpy as jnp, optax, exdyna_jax
    >>> tx = optax.MultiSteps(
    ...     optax.chain(exdyna_jax.topk(density=0.01), optax.sgd(0.1, momentum=0.9)),
    ...     every_k_schedule=4)
    >>> init = jax.vmap(tx.init, in_axes=None, axis_name="data", axis_size=8)
    >>> stats = exdyna_jax.get_stats(init(jnp.zeros(4096)))  # found however deep
    >>> type(stats).__name__, stats.step.shape
    ('SparsifierStats', (8,))

  Raises:
    ValueError: if the state holds several sparsifiers' stats (it names
      where each is).
  """
  is_stats = lambda node: isinstance(node, SparsifierStats)  # noqa: E731
  found = [jax.tree_util.keystr(path) for path, node in
           jax.tree_util.tree_flatten_with_path(opt_state, is_leaf=is_stats)[0] if is_stats(node)]
  if len(found) > 1:
    raise ValueError(
        f"The optimizer state holds {len(found)} sparsifiers' stats, at opt_state"
        f"{', opt_state'.join(found)} (several groups of optax.multi_transform, say): "
        "read each from its own part, e.g. exdyna_jax.get_stats(opt_state"
        f"{found[0].removesuffix('.stats')})."
    )
  stats = optax.tree.get(opt_state, "stats")
  if isinstance(stats, Mapping) and set(stats) == set(SparsifierStats._fields):
    stats = SparsifierStats(**stats)
  # An nnx variable hands out its array with get_value() (a jax.Array has no such method).
  return jax.tree.map(lambda leaf: leaf.get_value() if hasattr(leaf, "get_value") else leaf,
                      stats, is_leaf=lambda leaf: hasattr(leaf, "get_value"))
