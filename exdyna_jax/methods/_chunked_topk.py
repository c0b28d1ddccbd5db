"""Top-k in every chunk with error feedback, on a compact wire (as SparseLoCo's compressor)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from exdyna_jax.core import _collectives, _layout, _options, _stats
from exdyna_jax.exchange import _exchange, _packed, _quantized_all_reduce
from exdyna_jax.selection import _selection
from exdyna_jax.shell import _feedback

WIRES = ("all_gather", "all_reduce")


class QuantizedMeanState(NamedTuple):
  """Optimizer state of ``chunked_topk(1.0, value_bits=b, wire="all_reduce")`` (per worker).

  Attributes:
    residual: float32 ``[N]`` what the rounding of this worker's values lost.
    shard_residual: float32 ``[c L]`` what the rounding of this worker's
      shard of the workers' mean lost: owed to every worker's next update.
    stats: `SparsifierStats` of the last step.
    leaves_seen: `_layout.LeavesSeen`, static (`ErrorFeedbackState`'s).

  Example:
    Four workers, ``N = 10,000`` in chunks of 1,024: 10 chunks, 3 a shard
    (the last two all padding):

    >>> import jax, jax.numpy as jnp, exdyna_jax
    >>> tx = exdyna_jax.chunked_topk(1.0, chunk=1024, value_bits=1, wire="all_reduce")
    >>> init = jax.vmap(tx.init, in_axes=None, axis_name="data", axis_size=4)
    >>> state = init(jnp.zeros(10_000))
    >>> state.residual.shape, state.shard_residual.shape
    ((4, 10000), (4, 3072))
  """

  residual: jax.Array
  shard_residual: jax.Array
  stats: _stats.SparsifierStats
  leaves_seen: _layout.LeavesSeen | None = None


def chunked_topk(
    density: float | Mapping[int, float],
    *,
    chunk: int = 4096,
    value_bits: int | None = None,
    wire: str = "all_gather",
    mean_bits: int | None = None,
    axis_name: str = "data",
    value_dtype: Any = jnp.float32,
) -> optax.GradientTransformationExtraArgs:
  """Each worker's top ``m`` of every chunk, sent as ``log2 L``-bit offsets and low-bit values.

  The accumulated gradient (its ``N`` elements, zero-padded) is cut into
  chunks of ``L = chunk`` elements; each worker picks the ``m = ceil(k /
  chunks)`` largest magnitudes of each chunk (``k = floor(density * N)``),
  so the position of a pick in its message names its chunk, and its offset
  in the chunk fits ``ceil(log2 L)`` bits (12 for the default). Values go
  in ``value_dtype``, or with ``value_bits`` in 8, 4, 2 or 1 bits on a scale
  per chunk (`_packed`). One ``all_gather`` of each worker's bytes; every
  worker decodes all of them and the update is the sum of every worker's
  sent values over ``n``, at the union of their picks. Each worker keeps in
  its residual what it did not send and what the rounding of its own
  values lost.

  Unlike `topk`, whose workers all send their values at the union of every
  worker's indices (a ``psum`` of ``n k`` values), a worker here sends its
  own ``k`` values only: ``(n - 1) (log2 L + b) k / 8`` bytes on a ring
  all-gather for ``b``-bit values, against `topk`'s ``(n - 1) 12 k``. The
  mean at an index only some workers picked is their sum over ``n``: the
  others keep their part.

  With ``value_bits``, a density of 1.0 sends every element of every chunk
  in place, so the message needs no offsets: ``b`` bits an element and a
  scale a chunk (1 bit: the sign on the chunk's mean magnitude, a scaled
  sign with error feedback). With float values a density of 1.0 is the
  exact dense mean, as a schedule's level of 1.0 always is.

  Every element in ``b`` bits can go as an all-reduce instead of an
  all-gather (``wire="all_reduce"``): each worker sends every chunk's
  owner (the workers own contiguous shards of the chunks) its values there,
  the owner sends back the mean in ``mean_bits`` and keeps what that second
  rounding loses in its ``shard_residual`` (1-bit Adam's compressed
  all-reduce): ``(n - 1) / n`` of a message in each of ``b`` and
  ``mean_bits`` bits a worker, not ``n - 1`` messages
  (`_quantized_all_reduce`), so fewer bytes than the all-gather's from
  ``n = 4`` (a quarter fewer at 1 and 2 bits) and ever fewer as ``n`` grows.

  The stats count ``selected = n k'`` and ``transmitted`` = the distinct
  indices sent (``k' = m chunks >= k``, each worker's ``workloads``;
  ``target`` is ``k``); ``threshold`` is the smallest magnitude sent.

  Calling convention: :doc:`/usage`; non-finite gradients: :doc:`/bad_inputs`.

  Args:
    density: fraction ``d`` of gradient elements each worker picks, in
      ``(0, 1]``, or a schedule ``{first_step: density}`` (:doc:`/usage`).
    chunk: elements per chunk, ``L``, at most 65,536 (an offset takes
      ``ceil(log2 L)`` bits); a model smaller than it is one chunk.
    value_bits: None (default: values in ``value_dtype``), or 8, 4, 2 or 1:
      a sign and ``b - 1`` bits of magnitude on a scale per chunk, fitted
      to the chunk's picks by least squares (for 1, the sign alone on
      about their mean magnitude).
    wire: ``"all_gather"`` (default): every worker's message to every
      worker; or ``"all_reduce"``, for a density of 1.0 with ``value_bits``:
      a quantized reduce-scatter to each shard's owner, then an all-gather
      of the owners' quantized means.
    mean_bits: for ``wire="all_reduce"``, the bits of the owners' means: 8,
      4, 2 or 1. None (default): twice ``value_bits``, at most 8 (the mean of
      ``n`` workers' values takes more levels than each; one bit for the
      mean of 1-bit values trained far worse, docs/usage.md).
    axis_name: name of the data-parallel axis.
    value_dtype: float32 (default), bfloat16 or float16: the values' dtype
      on the wire where ``value_bits`` is None.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is an
    `ErrorFeedbackState` (a `QuantizedMeanState` for ``wire="all_reduce"``).

  Raises:
    ValueError: for a ``chunk`` past 65,536, ``value_bits`` not listed,
      both ``value_bits`` and a narrow ``value_dtype``, an unknown ``wire``
      (``"all_reduce"`` without a density of 1.0 and ``value_bits``), or
      ``mean_bits`` not listed or without ``wire="all_reduce"``.

  References:
    Sarfi et al., "SparseLoCo: Communication-Efficient LLM Training ...",
    2025 (arXiv 2508.15706). Stich et al., "Sparsified SGD with Memory",
    NeurIPS 2018.

  Example:
    Eight workers under ``jax.vmap``, 1 % of ``N = 8000`` each in chunks of
    1,000 (10 a chunk), values in 2 bits:

    >>> import jax, jax.numpy as jnp, exdyna_jax
    >>> tx = exdyna_jax.chunked_topk(0.01, chunk=1000, value_bits=2)
    >>> params = jnp.zeros(8000)
    >>> def step(grads):
    ...   updates, state = tx.update(grads, tx.init(params), params)
    ...   return updates, exdyna_jax.get_stats(state)
    >>> grads = jax.random.normal(jax.random.key(0), (8, 8000))
    >>> updates, stats = jax.jit(jax.vmap(step, axis_name="data"))(grads)
    >>> int(stats.target[0]), int(stats.selected[0])  # 8 chunks of 10, by 8 workers
    (80, 640)
    >>> int(stats.bytes_sent[0])  # 7 x (100 offset + 20 value + 32 scale bytes), + the guard's 14
    1078
  """
  values_as = checked_values_as(chunk, value_bits, value_dtype)
  if checked_wire(wire, density, value_bits, mean_bits) == "all_reduce":
    return quantized_mean(chunk, value_bits, mean_bits or min(2 * value_bits, 8), axis_name)

  def sparsify(accumulated, stats, num_workers, k):
    num_elements = accumulated.shape[0]
    length = min(chunk, num_elements)
    per_chunk = length if k == num_elements else min(length, -(-k // -(-num_elements // length)))
    picks = pick_in_chunks(accumulated, length, per_chunk)
    _exchange.check_gathered_size(num_workers, picks.offsets.size)
    gathered = _packed.gather(picks, length, axis_name, values_as)
    indices = flat_indices(gathered.offsets, length, num_elements)
    values = gathered.values.reshape(-1)
    if per_chunk == length:
      sparse, transmitted = averaged(accumulated, values, axis_name)
    else:
      sparse, transmitted = summed(accumulated, indices, values, axis_name)
    new_stats = _stats.unpartitioned_stats(
        stats,
        threshold=jnp.min(jnp.where(indices < num_elements, jnp.abs(values), jnp.inf)),
        selected=jnp.int32(num_workers * picks.offsets.size),
        transmitted=transmitted,
        overflow=jnp.zeros((), jnp.int32),
        workloads=jnp.full((num_workers,), picks.offsets.size, jnp.int32),
        num_elements=num_elements,
        bytes_sent=_collectives.ring_all_gather_bytes(
            num_workers, _packed.message_bytes(*picks.offsets.shape, length, values_as)),
        target=k,
    )
    return sparse, new_stats

  return _feedback.fixed_budget_transform(density, axis_name=axis_name, sparsify=sparsify,
                                         dense_at_one=not _packed.quantized(values_as))


def checked_wire(wire: str, density: float | Mapping[int, float], value_bits: int | None,
                 mean_bits: int | None) -> str:
  """``wire``, checked against the options it needs."""
  if wire not in WIRES:
    raise ValueError(f"wire must be one of {WIRES}, got {wire!r}.")
  if wire == "all_reduce" and (value_bits is None or isinstance(density, Mapping)
                               or density != 1.0):
    raise ValueError(
        "wire='all_reduce' sends every element in value_bits bits: pass density=1.0 and "
        f"value_bits (got density={density!r}, value_bits={value_bits!r}).")
  if mean_bits is not None and (wire != "all_reduce" or mean_bits not in _packed.VALUE_BITS
                                or isinstance(mean_bits, bool)):
    raise ValueError(f"mean_bits is for wire='all_reduce', one of {_packed.VALUE_BITS}; got "
                     f"mean_bits={mean_bits!r} with wire={wire!r}.")
  return wire


def quantized_mean(chunk: int, value_bits: int, mean_bits: int, axis_name: str
                   ) -> _collectives.Sparsifier:
  """Every element in ``value_bits`` bits, the owners' means in ``mean_bits``, on a quantized
  all-reduce (`_quantized_all_reduce`)."""

  def init_state(residual, num_elements, num_workers):
    shard = _quantized_all_reduce.shard_size(num_elements, min(chunk, num_elements), num_workers)
    return QuantizedMeanState(
        residual, _collectives.per_worker(jnp.zeros((shard,), jnp.float32), axis_name),
        _feedback.unpartitioned_initial_stats(0.0, num_elements, num_workers))

  def step(accumulated, state, num_workers):
    num_elements = accumulated.shape[0]
    length = min(chunk, num_elements)
    rows = _quantized_all_reduce.shards(accumulated, length, num_workers)
    reduced = _quantized_all_reduce.all_reduce(rows, state.shard_residual, axis_name,
                                               value_bits, mean_bits)
    mean = reduced.mean.reshape(-1)[:num_elements]
    stats = _stats.unpartitioned_stats(
        state.stats,
        threshold=jnp.min(jnp.abs(mean)),
        selected=jnp.int32(num_workers * rows[0].size),
        transmitted=jnp.int32(num_elements),
        overflow=jnp.zeros((), jnp.int32),
        workloads=jnp.full((num_workers,), rows[0].size, jnp.int32),
        num_elements=num_elements,
        bytes_sent=_quantized_all_reduce.sent_bytes(num_workers, rows[0].size, length,
                                                    value_bits, mean_bits),
        target=num_elements,
    )
    kept = accumulated - reduced.own.reshape(-1)[:num_elements]
    return (_exchange.SparseUpdate(jnp.arange(num_elements, dtype=jnp.int32), mean, kept=kept),
            state._replace(shard_residual=reduced.shard_residual, stats=stats))

  return _feedback.error_feedback_transform(axis_name=axis_name, init_state=init_state,
                                            step=step)


def checked_values_as(chunk: int, value_bits: int | None, value_dtype: Any) -> _packed.ValuesAs:
  """`_packed`'s ``values_as`` for the options, checked."""
  _options.check_positive_int(chunk, "chunk", "elements per chunk")
  if chunk > _packed.MAX_CHUNK:
    raise ValueError(f"chunk must be at most {_packed.MAX_CHUNK} (16-bit offsets), got {chunk}.")
  value_dtype = _options.check_value_dtype(value_dtype)
  if value_bits is None:
    return value_dtype
  if value_bits not in _packed.VALUE_BITS or isinstance(value_bits, bool):
    raise ValueError(f"value_bits must be None or one of {_packed.VALUE_BITS}, got "
                     f"{value_bits!r}.")
  if value_dtype != jnp.float32:
    raise ValueError(f"Pass value_bits={value_bits} or value_dtype={value_dtype}, not both.")
  return value_bits


def pick_in_chunks(accumulated: jax.Array, length: int, per_chunk: int) -> _packed.Picks:
  """The ``per_chunk`` largest magnitudes of each chunk of ``length`` (the tail zero-padded);
  all of them, in place, where ``per_chunk`` is ``length``."""
  chunks = -(-accumulated.shape[0] // length)
  rows = jnp.pad(accumulated, (0, chunks * length - accumulated.shape[0])).reshape(chunks, length)
  if per_chunk == length:
    return _packed.Picks(jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), rows.shape), rows)
  return _packed.Picks(*_selection.top_k_of_rows(rows, per_chunk))


def flat_indices(offsets: jax.Array, length: int, num_elements: int) -> jax.Array:
  """int32 ``[n chunks m]`` indices of the gathered ``offsets``; past ``N``: the sentinel."""
  starts = length * jnp.arange(offsets.shape[-2], dtype=jnp.int32)[:, None]
  return jnp.minimum(starts + offsets, num_elements).reshape(-1)


def averaged(accumulated: jax.Array, values: jax.Array, axis_name: str
             ) -> tuple[_exchange.SparseUpdate, jax.Array]:
  """Every element sent (``values`` ``[n chunks L]``, worker-major): the workers' mean, and
  ``N``. This worker keeps what the rounding took from its own values."""
  num_workers, num_elements = _collectives.axis_size(axis_name), accumulated.shape[0]
  values = values.reshape(num_workers, -1)[:, :num_elements]
  own = values[jax.lax.axis_index(axis_name)]
  return _exchange.SparseUpdate(jnp.arange(num_elements, dtype=jnp.int32),
                                jnp.sum(values, axis=0) / num_workers,
                                kept=accumulated - own), jnp.int32(num_elements)


SORT_FREE_SHARE = 4
"""`summed` adds the picks up in ``[N]`` buffers where they are at least ``N / 4``, else
it sorts them."""


def summed(accumulated: jax.Array, indices: jax.Array, values: jax.Array, axis_name: str
           ) -> tuple[_exchange.SparseUpdate, jax.Array]:
  """The update at every gathered index (worker-major, ``[M]``), and the count of distinct ones.

  The values summed where the ``M = n k'`` picks share an index give each
  index the workers' total there, over ``n`` (so duplicates carry the same
  value). This worker keeps ``a`` less its own sent value there: all of
  ``a`` where it sent nothing, the rounding of its value where it did.
  The update holds ``M`` pairs either way, so the residual is written in
  place.
  """
  num_workers, num_elements = _collectives.axis_size(axis_name), accumulated.shape[0]
  row = jnp.arange(indices.shape[0], dtype=jnp.int32) // (indices.shape[0] // num_workers)
  own = jnp.where(row == jax.lax.axis_index(axis_name), values, 0.0)
  sums = buffered_sums if indices.size >= num_elements // SORT_FREE_SHARE else sorted_sums
  sum_at_picks, distinct = sums(indices, num_elements)
  kept = accumulated.at[indices].get(mode="fill", fill_value=0) - sum_at_picks(own)
  return _exchange.SparseUpdate(indices, sum_at_picks(values) / num_workers, kept=kept), distinct


def sorted_sums(indices: jax.Array, num_elements: int
                ) -> tuple[Callable[[jax.Array], jax.Array], jax.Array]:
  """Sums over the picks of each index, through one sort of them: ``O(M log M)``, no ``[N]``.

  Each pick finds its index's first place among the sorted indices, a slot
  its duplicates share. Returns the summing function (``[M] -> [M]``, each
  pick its index's total) and the count of distinct indices below ``N``.
  """
  ordered = jnp.sort(indices)
  slot = jnp.searchsorted(ordered, indices).astype(jnp.int32)

  def sum_at_picks(x):
    return jnp.zeros_like(x).at[slot].add(x)[slot]

  return sum_at_picks, _exchange.distinct_in_sorted(ordered, num_elements)


def buffered_sums(indices: jax.Array, num_elements: int
                  ) -> tuple[Callable[[jax.Array], jax.Array], jax.Array]:
  """`sorted_sums` through ``[N]`` buffers: ``O(N + M)``, no sort.

  Cheaper where the picks are of the order of ``N`` (a density warm-up's
  first levels); the sentinel ``N`` is dropped and reads zero.
  """
  def sum_at_picks(x):
    totals = jnp.zeros(num_elements, x.dtype).at[indices].add(x, mode="drop")
    return totals.at[indices].get(mode="fill", fill_value=0)

  sent = jnp.zeros(num_elements, bool).at[indices].set(True, mode="drop")
  return sum_at_picks, jnp.sum(sent, dtype=jnp.int32)
