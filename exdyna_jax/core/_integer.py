"""Exact integer arithmetic for the reference rules, without 64-bit types.

The published controllers compare integer counts against float64 ratios
(``kappa / kbar > 1.05``) and take ``floor(s * K / N)``. JAX runs with 32-bit
types by default, where ``s * K`` overflows and float32 ratios round. Every
such comparison is a bound of the form ``x > floor(x' * num / den)``, so one
exact ``floor_mul_div`` serves them all.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def floor_mul_div(x: jax.Array, numerator: int, denominator: int) -> jax.Array:
  """Returns ``floor(x * numerator / denominator)`` exactly, in int32.

  A float32 estimate is corrected with the exact remainder, computed modulo
  ``2**32`` in unsigned arithmetic (which wraps by definition in XLA); the
  remainder is small enough to be recovered exactly from its low 32 bits.

  Args:
    x: non-negative int32 array.
    numerator: non-negative Python int below ``2**32``.
    denominator: positive Python int below ``2**31``.

  Returns:
    int32 array of the same shape as ``x``. Exact while
    ``(2e-7 * result + 2) * denominator < 2**31``, which holds for every use in
    this package (counts and indices below ``2**31``).
  """
  x = jnp.asarray(x, jnp.int32)
  ratio = numerator / denominator
  estimate = jnp.floor(x.astype(jnp.float32) * jnp.float32(ratio)).astype(jnp.int32)
  wrapped = x.astype(jnp.uint32) * jnp.uint32(numerator) - estimate.astype(
      jnp.uint32
  ) * jnp.uint32(denominator)
  remainder = jax.lax.bitcast_convert_type(wrapped, jnp.int32)
  return estimate + jnp.floor_divide(remainder, denominator)


def exceeds_ratio(x: jax.Array, y: jax.Array, numerator: int, denominator: int) -> jax.Array:
  """Exact ``x / y > numerator / denominator`` for non-negative int32 counts."""
  return x > floor_mul_div(y, numerator, denominator)


def below_ratio(x: jax.Array, y: jax.Array, numerator: int, denominator: int) -> jax.Array:
  """Exact ``x / y < numerator / denominator`` for non-negative int32 counts.

  ``x * denominator < y * numerator`` holds exactly when
  ``y > floor(x * denominator / numerator)``.
  """
  return y > floor_mul_div(x, denominator, numerator)
