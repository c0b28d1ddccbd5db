"""AdamW for a sparsified exchange: each worker's own second moment, error feedback as momentum.

Momentum or Adam after a sparsifier sees what error feedback releases: a
coordinate's residual, many steps of its gradient, all at once. Momentum
then keeps pushing that burst for tens of steps while the residual refills,
and Adam's normalisation turns every burst into a step of about
``lr / sqrt(1 - b2)``; both train far worse than without the sparsifier
(`docs/usage.md`, "Momentum and Adam with a sparsifier").

`sparse_adamw` keeps what Adam's preconditioning gives and lets the
residual be the momentum: each worker divides its own gradient by the root
of its own running second moment (Adam's ``v``, never exchanged), the
sparsifier exchanges that with error feedback, and the aggregate is applied
with decoupled weight decay and the learning rate.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from exdyna_jax.core import _stats


class LocalRMSState(NamedTuple):
  """State of `scale_by_local_rms` (per worker).

  Attributes:
    count: int32 steps taken.
    nu: this worker's running mean of its squared gradients, float32, shaped
      like the parameters.

  Example:
    >>> import jax, jax.numpy as jnp, exdyna_jax
    >>> tx = exdyna_jax.scale_by_local_rms()
    >>> state = tx.init(jnp.zeros(3))
    >>> _, state = tx.update(jnp.array([1.0, -2.0, 0.0]), state)
    >>> state.nu  # (1 - 0.999) g**2
    Array([0.001, 0.004, 0.   ], dtype=float32)
  """

  count: jax.Array
  nu: Any


def scale_by_local_rms(b2: float = 0.999, eps: float = 1e-8) -> optax.GradientTransformation:
  """Divides a gradient by the root of its running second moment, as Adam does, with no momentum.

  ``v = b2 v + (1 - b2) g**2``, ``u = g / (sqrt(v / (1 - b2**t)) + eps)``:
  Adam's update with ``b1 = 0``. Chained before a sparsifier it runs on each
  worker's own gradient (the state is each worker's own, never exchanged).

  Args:
    b2: decay of the second moment.
    eps: added to the root, as in Adam.

  Returns:
    The optax transformation; its state is a `LocalRMSState`.

  Example:
    >>> import jax.numpy as jnp, exdyna_jax
    >>> tx = exdyna_jax.scale_by_local_rms()
    >>> g = jnp.array([0.5, -4.0])
    >>> updates, state = tx.update(g, tx.init(g))
    >>> updates.round(4)  # the first step: g / |g|, as Adam's first step
    Array([ 1., -1.], dtype=float32)
  """

  def init_fn(params):
    nu = jax.tree.map(lambda p: jnp.zeros_like(p, jnp.float32), params)  # sharded like p
    return LocalRMSState(jnp.zeros([], jnp.int32), nu)

  def update_fn(updates, state, params=None):
    del params
    count = state.count + 1
    nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * jnp.square(g.astype(jnp.float32)),
                      state.nu, updates)
    correction = 1 - b2 ** count.astype(jnp.float32)
    scaled = jax.tree.map(
        lambda g, v: (g / (jnp.sqrt(v / correction) + eps)).astype(g.dtype), updates, nu)
    return scaled, LocalRMSState(count, nu)

  return optax.GradientTransformation(init_fn, update_fn)


def sparse_adamw(
    sparsifier: optax.GradientTransformation,
    learning_rate: optax.ScalarOrSchedule,
    *,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1e-4,
    mask: Any = None,
) -> optax.GradientTransformationExtraArgs:
  """AdamW for a sparsified exchange: what to use in place of ``chain(sparsifier, adamw)``.

  ``chain(scale_by_local_rms(b2, eps), sparsifier, add_decayed_weights,
  scale_by_learning_rate)``: each worker preconditions its own gradient by
  its own second moment, the sparsifier exchanges the result with error
  feedback (its residual accumulates what is not sent, as Adam's first
  moment would average it), and the workers' mean is applied with
  decoupled weight decay. With ``dense()`` as the sparsifier it is Adam
  without momentum (``b1 = 0``) on the mean of the workers' preconditioned
  gradients.

  Chain clipping before it: ``optax.chain(optax.clip_by_global_norm(1.0),
  sparse_adamw(...))`` (each worker clips its own gradient).

  Args:
    sparsifier: a method of this package. ``chunked_topk(6 * d / n,
      value_bits=2)`` on ``n`` workers (each worker's own largest of every
      chunk in 2 bits, about the bytes of ``d`` of the coordinates in
      float32) kept the most quality per byte on the transformer language
      models measured, then ``topk(d / n, exact=False)`` (each worker's own
      ``d / n`` largest, about ``d`` of the coordinates in all; :doc:`/usage`,
      "Momentum and Adam with a sparsifier"); ``exdyna(d)`` sends exactly
      ``d``.
    learning_rate: as for ``optax.adamw`` (a number or a schedule). With
      either, about twice dense AdamW's best peak served best on the
      transformers measured (:doc:`/usage`).
    b2: decay of each worker's second moment.
    eps: added to the root of the second moment.
    weight_decay: decoupled weight decay, as for ``optax.adamw``.
    mask: which parameters decay, as for ``optax.adamw``.

  Returns:
    The optax transformation.

  Example:
    >>> import jax, jax.numpy as jnp, optax, exdyna_jax
    >>> tx = exdyna_jax.sparse_adamw(exdyna_jax.exdyna(0.01), 1e-3)
    >>> params = jnp.zeros(4096)
    >>> def step(g):  # per worker
    ...   return tx.update(g, tx.init(params), params)
    >>> grads = jax.random.normal(jax.random.key(0), (8, 4096))
    >>> updates, state = jax.jit(jax.vmap(step, axis_name="data"))(grads)
    >>> sent = int(exdyna_jax.get_stats(state).transmitted[0])  # about k = 40
    >>> moved = int(jnp.sum(updates[0] != 0))  # a sent sum can round to 0
    >>> sent - 2 <= moved <= sent, 30 < sent < 50  # only what was sent moves
    (True, True)
  """
  return optax.chain(
      scale_by_local_rms(b2, eps),
      _stats.require_exchange(sparsifier, "sparse_adamw's sparsifier"),
      optax.add_decayed_weights(weight_decay, mask),
      optax.scale_by_learning_rate(learning_rate),
  )
