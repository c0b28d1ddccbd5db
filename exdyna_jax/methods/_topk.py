"""Top-k sparsification with error feedback and an index-union exchange."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import optax

from exdyna_jax.core import _collectives, _options, _stats
from exdyna_jax.exchange import _exchange
from exdyna_jax.selection import _selection
from exdyna_jax.shell import _feedback


def topk(
    density: float | Mapping[int, float],
    *,
    axis_name: str = "data",
    value_dtype: Any = jnp.float32,
) -> optax.GradientTransformationExtraArgs:
  """Exact local top-k with error feedback, as an optax transform.

  Each worker picks the ``k = floor(density * N)`` largest magnitudes of its
  own accumulated gradient (``lax.top_k``, a sort-like pass over all ``N``
  elements); the workers all-gather the ``[n, k]`` index lists and sum their
  values at all of them, so the update is the mean of all workers'
  accumulated gradients on the union of their choices. Workers disagree, so
  the union grows from ``k`` towards ``n k`` (gradient build-up): the stats
  report ``selected = n k`` and ``transmitted`` = the number of distinct
  indices in the union. Duplicates are harmless (every copy of an index
  carries the same sum) but still cost traffic: ``bytes_sent`` is that of
  ``n k`` slots.

  ``stats.threshold`` is the smallest of the workers' ``k``-th largest
  magnitudes (it rides on the index all-gather); ``stats.workloads`` is ``k``
  per worker.

  Calling convention: :doc:`/usage`; non-finite gradients: :doc:`/bad_inputs`.

  Args:
    density: fraction ``d`` of gradient elements each worker picks, in
      ``(0, 1]``, or a schedule ``{first_step: density}`` (`dgc_warmup`,
      :doc:`/usage`).
    axis_name: name of the data-parallel axis.
    value_dtype: float32 (default), bfloat16 or float16: what the values at
      the union of the workers' indices are summed in (:doc:`/usage`).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is an
    `ErrorFeedbackState`.

  References:
    Aji & Heafield, "Sparse Communication for Distributed Gradient Descent",
    EMNLP 2017. Stich et al., "Sparsified SGD with Memory", NeurIPS 2018.

  Example:
    Eight workers, one per forced CPU device, under ``jax.shard_map``
    (``N = 4096``, ``k = 40``):

    >>> import jax, jax.numpy as jnp, exdyna_jax
    >>> from jax import P
    >>> n, k = 8, 40
    >>> mesh = jax.make_mesh((n,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    >>> tx = exdyna_jax.topk(density=0.01)
    >>> params = jnp.zeros(4096)
    >>> def step(grads):  # runs per device, on its own [1, N] slice
    ...   updates, state = tx.update(grads[0], tx.init(params), params)
    ...   return updates, exdyna_jax.get_stats(state)
    >>> step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("data"), out_specs=P(),
    ...                              check_vma=False))
    >>> grads = jax.random.normal(jax.random.key(0), (n, 4096))
    >>> updates, stats = step(grads)

    Each worker sends its own ``k``; they disagree, so the union is larger
    than ``k`` (gradient build-up):

    >>> int(stats.selected)
    320
    >>> bool(k < stats.transmitted <= n * k)
    True
    >>> int((updates != 0).sum()) == int(stats.transmitted)
    True
  """

  value_dtype = _options.check_value_dtype(value_dtype)

  def sparsify(accumulated, stats, num_workers, k):
    num_elements = accumulated.shape[0]
    indices, kth = _selection.select_top_k(accumulated, k)
    exchanged = _exchange.exchange(
        accumulated, indices, _collectives.float_bits(kth)[None], axis_name,
        value_dtype=value_dtype,
    )
    selected = jnp.int32(num_workers * k)
    new_stats = _stats.unpartitioned_stats(
        stats,
        threshold=_collectives.bits_float(jnp.min(exchanged.gathered_info[:, 0])),
        selected=selected,
        transmitted=_exchange.distinct_count(exchanged.gathered_indices, num_elements),
        overflow=jnp.zeros((), jnp.int32),
        workloads=jnp.full((num_workers,), k, jnp.int32),
        num_elements=num_elements,
        bytes_sent=exchanged.bytes_sent,
        target=k,
    )
    return exchanged.sparse, new_stats

  return _feedback.fixed_budget_transform(density, axis_name=axis_name, sparsify=sparsify)

