"""CLT-k: the top-k of a rotating leader, shared by every worker."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

from exdyna_jax.core import _collectives, _options, _stats
from exdyna_jax.exchange import _exchange
from exdyna_jax.selection import _selection
from exdyna_jax.shell import _feedback


def cltk(
    density: float | Mapping[int, float],
    *,
    axis_name: str = "data",
    value_dtype: Any = jnp.float32,
) -> optax.GradientTransformationExtraArgs:
  """Cyclic local top-k (CLT-k) with error feedback, as an optax transform.

  At step ``t`` the leader ``t mod n`` picks the ``k = floor(density * N)``
  largest magnitudes of its own accumulated gradient; every worker sums its
  accumulated gradient at those indices, so the update is the mean of all
  workers' accumulated gradients there (exactly ``k`` indices: no build-up),
  and every worker clears them from its residual.

  Traffic: the leader's ``k`` indices reach the others as one integer
  all-reduce in which every other worker contributes zeros (``2 (n-1)/n k``
  indices sent per worker on a ring, against ``(n-1) k`` for all-gathering
  every worker's list to keep one), then the ``k`` values are all-reduced.
  Only the leader runs the top-k (a ``lax.cond`` on the rank; under
  ``jax.vmap`` both branches run).

  ``stats.threshold`` is the leader's ``k``-th largest magnitude (one more
  integer on the index all-reduce); ``stats.workloads`` is ``k`` for the
  leader and 0 for the others.

  Calling convention: :doc:`/usage`; non-finite gradients: :doc:`/bad_inputs`.

  Args:
    density: fraction ``d`` of gradient elements the leader picks and every
      worker sends, in ``(0, 1]``, or a schedule ``{first_step: density}``
      (`dgc_warmup`, :doc:`/usage`).
    axis_name: name of the data-parallel axis.
    value_dtype: float32 (default), bfloat16 or float16: what the values at
      the leader's indices are summed in (:doc:`/usage`).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is an
    `ErrorFeedbackState`.

  References:
    Chen et al., "ScaleCom: Scalable Sparsified Gradient Compression for
    Communication-Efficient Distributed Training", NeurIPS 2020.

  Example:
    Four workers simulated with ``jax.vmap``, ``N = 8``, ``k = 2``, two
    steps; worker 0 has large elements at step 0, worker 1 at step 1:

    >>> import jax, jax.numpy as jnp, exdyna_jax
    >>> tx = exdyna_jax.cltk(density=0.25)
    >>> params = jnp.zeros(8)
    >>> grads = jnp.full((4, 2, 8), 0.1)  # [worker, step, element]
    >>> grads = grads.at[0, 0, :2].set(1.0).at[1, 1, 4:6].set(1.0)
    >>> def two_steps(g):  # runs per worker
    ...   state = tx.init(params)
    ...   first, state = tx.update(g[0], state, params)
    ...   second, state = tx.update(g[1], state, params)
    ...   return first, second
    >>> first, second = jax.jit(jax.vmap(two_steps, axis_name="data", axis_size=4))(grads)

    Step 0 sends the top-2 of the leader worker 0, step 1 those of worker 1:

    >>> print(jnp.flatnonzero(first[0]), jnp.flatnonzero(second[0]))
    [0 1] [4 5]
    >>> round(float(first[0, 0]), 4)  # mean of 1.0, 0.1, 0.1 and 0.1
    0.325
  """

  value_dtype = _options.check_value_dtype(value_dtype)

  def sparsify(accumulated, stats, num_workers, k):
    num_elements = accumulated.shape[0]
    leader = stats.step % num_workers

    def lead(accumulated):
      indices, kth = _selection.select_top_k(accumulated, k)
      return jnp.concatenate([indices, _collectives.float_bits(kth)[None]])

    def follow(accumulated):
      del accumulated
      return _collectives.per_worker(jnp.zeros((k + 1,), jnp.int32), axis_name)

    mine = jax.lax.cond(jax.lax.axis_index(axis_name) == leader, lead, follow, accumulated)
    chosen = _collectives.broadcast_from(mine, leader, axis_name)
    sparse = _exchange.aggregate_at(accumulated, chosen[:k], axis_name, value_dtype)
    index_bytes = (k + 1) * _collectives.INDEX_BYTES
    value_bytes = k * value_dtype.itemsize
    new_stats = _stats.unpartitioned_stats(
        stats,
        threshold=_collectives.bits_float(chosen[k]),
        selected=jnp.int32(k),
        transmitted=jnp.int32(k),
        overflow=jnp.zeros((), jnp.int32),
        workloads=jnp.where(jnp.arange(num_workers) == leader, k, 0).astype(jnp.int32),
        num_elements=num_elements,
        bytes_sent=_collectives.ring_all_reduce_bytes(num_workers, index_bytes)
        + _collectives.ring_all_reduce_bytes(num_workers, value_bytes),
        target=k,
    )
    return sparse, new_stats

  return _feedback.fixed_budget_transform(density, axis_name=axis_name, sparsify=sparsify)
