"""Every sparsifier by name, for configuration files and benchmarks.

A new method registers itself by adding its factory to `SPARSIFIERS`, here
in the source (the mapping is read-only); the tests, the benchmarks and
their report read their lists of methods from it.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping
from typing import Any

import optax

from exdyna_jax.methods._chunked_topk import chunked_topk
from exdyna_jax.methods._cltk import cltk
from exdyna_jax.methods._dense import dense
from exdyna_jax.methods._hard_threshold import hard_threshold
from exdyna_jax.methods._micro import micro
from exdyna_jax.methods._spardl import spardl
from exdyna_jax.methods._topk import topk
from exdyna_jax.methods.exdyna._exdyna import exdyna

Factory = Callable[..., optax.GradientTransformationExtraArgs]

# In the order reports list them: ExDyna and its relatives, the baselines, dense last.
SPARSIFIERS: Mapping[str, Factory] = types.MappingProxyType({
    "exdyna": exdyna,
    "micro": micro,
    "spardl": spardl,
    "topk": topk,
    "cltk": cltk,
    "hard_threshold": hard_threshold,
    "chunked_topk": chunked_topk,
    "dense": dense,
})


def available_sparsifiers() -> tuple[str, ...]:
  """Names accepted by `get_sparsifier`, sorted.

  Example:
    >>> import exdyna_jax
    >>> exdyna_jax.available_sparsifiers()
    ('chunked_topk', 'cltk', 'dense', 'exdyna', 'hard_threshold', 'micro', 'spardl', 'topk')
  """
  return tuple(sorted(SPARSIFIERS))


def get_sparsifier(name: str, **options: Any) -> optax.GradientTransformationExtraArgs:
  """Builds the sparsifier called ``name`` with keyword ``options``.

  Args:
    name: one of `available_sparsifiers` (case and ``-``/``_`` are ignored).
    **options: the factory's arguments, e.g. ``density=0.001`` (``dense``
      takes none but ``axis_name``).

  Returns:
    The optax transformation.

  Raises:
    ValueError: for an unknown name, listing the valid ones.

  Example:
    >>> import optax, exdyna_jax
    >>> tx = exdyna_jax.get_sparsifier("Hard-Threshold", density=0.01)
    >>> isinstance(tx, optax.GradientTransformationExtraArgs)
    True
    >>> tx = exdyna_jax.get_sparsifier("exdyna", density=0.001, num_blocks=256)
    >>> tx = exdyna_jax.get_sparsifier("top-k", density=0.01)  # the same as "topk"
    >>> exdyna_jax.get_sparsifier("powersgd", density=0.01)
    Traceback (most recent call last):
      ...
    ValueError: Unknown sparsifier 'powersgd'; valid names: chunked_topk, cltk, dense, ...
  """
  return SPARSIFIERS[registered_name(name)](**options)


def registered_name(name: str) -> str:
  """The registered name ``name`` means, ignoring case, ``-`` and ``_``.

  Raises:
    ValueError: for an unknown name, listing the valid ones.
  """
  by_key = {_key(known): known for known in SPARSIFIERS}
  known = by_key.get(_key(name)) if isinstance(name, str) else None
  if known is None:
    raise ValueError(
        f"Unknown sparsifier {name!r}; valid names: {', '.join(available_sparsifiers())}."
    )
  return known


def _key(name: str) -> str:
  """``name`` without case, ``-`` or ``_``: "Top-K", "top_k" and "topk" are one name."""
  return name.lower().replace("-", "").replace("_", "")
