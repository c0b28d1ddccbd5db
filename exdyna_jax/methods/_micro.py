"""MiCRO: exclusive, static element partitions."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import optax

from exdyna_jax.core import _options
from exdyna_jax.methods.exdyna import _exdyna, _partition

DEFAULT_CAPACITY_FACTOR = _options.REFERENCE_CAPACITY_FACTOR  # the published buffers


def micro(
    density: float | Mapping[int, float],
    *,
    axis_name: str = "data",
    capacity_factor: float = DEFAULT_CAPACITY_FACTOR,
    controller: str = "adaptive",
    value_dtype: Any = jnp.float32,
) -> optax.GradientTransformationExtraArgs:
  """MiCRO gradient sparsification with error feedback, as an optax transform.

  ExDyna without blocks and without partition adjustment: the flat gradient
  is cut once into ``n`` contiguous partitions of ``floor(N / n)`` elements
  (one more for the first ``N mod n``). At step ``t`` worker ``w`` selects
  ``|a| >= threshold`` inside partition ``(t mod n + w) mod n`` only (or the
  single index ``start + t mod len`` when nothing passes); the workers
  exchange indices and sum values there, exactly as in `exdyna`. The
  selections are disjoint, so there is no gradient build-up, but nothing
  evens out the partitions' workloads: when gradient magnitude is uneven
  along the flat vector, ``stats.imbalance`` stays high and the fullest
  buffer sets the traffic (elements past ``capacity_factor * k / n`` stay in
  the residual and are counted as ``stats.overflow``).

  Calling convention: :doc:`/usage`; non-finite gradients: :doc:`/bad_inputs`.

  Args:
    density: fraction of gradient elements to send per step, in ``(0, 1]``. Or a schedule
      ``{first_step: density}`` (`dgc_warmup`, :doc:`/usage`).
    axis_name: name of the data-parallel axis.
    value_dtype: float32 (default), bfloat16 or float16: what the exchanged
      values are summed in (:doc:`/usage`).
    capacity_factor: per-worker index buffer size as a multiple of ``k / n``.
    controller: ``"adaptive"`` (default) or ``"reference"`` (the published
      threshold rule, exactly).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is an
    `ExDynaState` (partition sizes counted in elements).

  References:
    Yoon & Oh, "MiCRO: Near-Zero Cost Gradient Sparsification for Scaling and
    Accelerating Distributed DNN Training", HiPC 2023, arXiv:2310.00967.

  Example:
    Eight workers simulated with ``jax.vmap``, gradient magnitude growing
    along the vector (``N = 4096``, ``k = 40``), 20 steps:

    >>> import jax, jax.numpy as jnp, exdyna_jax
    >>> n = 8
    >>> tx = exdyna_jax.micro(density=0.01)
    >>> params = jnp.zeros(4096)
    >>> def train(grads):  # runs per worker
    ...   state = tx.init(params)
    ...   state, _ = jax.lax.scan(lambda s, g: (tx.update(g, s, params)[1], None), state, grads)
    ...   return exdyna_jax.get_stats(state)
    >>> scale = jnp.linspace(0.1, 2.0, 4096)
    >>> grads = scale * jax.random.normal(jax.random.key(0), (n, 20, 4096))
    >>> stats = jax.jit(jax.vmap(train, axis_name="data", axis_size=n))(grads)

    The partitions (in elements) never move, so the last ones, where the
    large elements are, hold most of the workload and overflow their buffers:

    >>> print(stats.partition_sizes[0])
    [512 512 512 512 512 512 512 512]
    >>> bool(stats.imbalance[0] > 2), bool(stats.overflow[0] > 0)
    (True, True)
  """
  return _exdyna.exdyna(
      density,
      axis_name=axis_name,
      capacity_factor=capacity_factor,
      controller=controller,
      partitioner=_partition.STATIC,
      value_dtype=value_dtype,
      spill=False,
  )
