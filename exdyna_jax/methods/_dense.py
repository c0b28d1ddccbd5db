"""Dense data parallelism: the mean all-reduce the sparsifiers are measured against."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from exdyna_jax.core import _collectives, _layout, _stats
from exdyna_jax.shell import _feedback, _guard


class DenseState(NamedTuple):
  """Optimizer state of `dense` (per worker; no residual: nothing is held back).

  Attributes:
    stats: `SparsifierStats` of the last step.
    leaves_seen: `_layout.LeavesSeen`, static: which leaves of the params
      tree ``init`` saw (None in a state unpickled from before it).

  Example:
    >>> import jax, jax.numpy as jnp, exdyna_jax
    >>> tx = exdyna_jax.dense()
    >>> state = jax.vmap(tx.init, in_axes=None, axis_name="data", axis_size=8)(jnp.zeros(16))
    >>> isinstance(state, exdyna_jax.DenseState), state.stats.workloads.shape
    (True, (8, 8))
  """

  stats: _stats.SparsifierStats
  leaves_seen: _layout.LeavesSeen | None = None


def dense(*, axis_name: str = "data") -> _collectives.Sparsifier:
  """The plain mean all-reduce, with the sparsifiers' interface and stats.

  ``update`` returns ``psum(grads) / n`` (computed in float32, returned in
  each leaf's dtype), identical on every worker. The stats report all ``N``
  elements as selected and transmitted by every worker, a threshold of 0, and
  the bytes of a ring all-reduce of ``N`` float32 values.

  Calling convention: :doc:`/usage`; non-finite gradients: :doc:`/bad_inputs`.

  Args:
    axis_name: name of the data-parallel axis.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    `DenseState`.

  Example:
    Eight workers, one per forced CPU device, under ``jax.pmap``:

    >>> import jax, jax.numpy as jnp, exdyna_jax
    >>> tx = exdyna_jax.dense()
    >>> params = jnp.zeros(4096)
    >>> def step(g):  # runs per device
    ...   return tx.update(g, tx.init(params), params)
    >>> grads = jax.random.normal(jax.random.key(0), (8, 4096))
    >>> updates, state = jax.pmap(step, axis_name="data")(grads)
    >>> bool(jnp.allclose(updates, grads.mean(0), atol=1e-6))
    True
    >>> int(state.stats.transmitted[0])  # every element, every step
    4096
  """

  def init_fn(params: Any) -> DenseState:
    layout = _layout.layout_of(params, what="params")
    num_workers = _collectives.axis_size(axis_name)
    return DenseState(
        _stats.initial_stats(0.0, *_stats.whole_vector(num_workers, layout.num_elements)),
        _layout.leaves_seen(params),
    )

  def update_fn(updates, state, params=None, **extra_args):
    del extra_args
    layout, num_workers = _feedback.check_update(updates, state, params, axis_name)
    screened = _guard.screen(updates, state.stats, num_workers, axis_name)
    total = jax.lax.psum(
        jax.tree.map(lambda g: g.astype(_layout.ACCUMULATION_DTYPE), updates), axis_name
    )
    mean = jax.tree.map(lambda s, g: (s / num_workers).astype(g.dtype), total, updates)
    count = jnp.int32(layout.num_elements)
    stats = _stats.unpartitioned_stats(
        state.stats,
        threshold=jnp.zeros((), jnp.float32),
        selected=count,
        transmitted=count,
        overflow=jnp.zeros((), jnp.int32),
        workloads=jnp.full((num_workers,), layout.num_elements, jnp.int32),
        num_elements=layout.num_elements,
        bytes_sent=_collectives.ring_all_reduce_bytes(
            num_workers, layout.num_elements * _collectives.VALUE_BYTES
        ),
        target=layout.num_elements,
    )
    # Leaves sharded over an Explicit axis (tensor parallel) are summed shard by shard.
    return _guard.skip_if_nonfinite(
        screened, lambda: (mean, state._replace(stats=stats)), (), state,
        skipped=lambda shapes: jax.tree.map(jnp.zeros_like, mean))

  return _collectives.Sparsifier(init_fn, update_fn, axis_name)
