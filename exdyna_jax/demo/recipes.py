"""What each method of the demo trains with: the shared hyper-parameters and the optimizers.

`TrainConfig` holds what every method of a comparison shares; `optimizer_for`
builds a method's optimizer from it as a user would write it (the
sparsifier on each worker's own gradient, AdamW after a sparsifier as
`exdyna_jax.sparse_adamw`, local steps with ``sync_every > 1``).
"""

from __future__ import annotations

import dataclasses

import jax
import optax

import exdyna_jax

AXIS = "data"


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Hyper-parameters shared by every method of a comparison.

  Attributes:
    steps: optimizer steps.
    density: fraction of gradient elements a sparsifier sends per step.
    batch_per_worker: examples per worker per step.
    learning_rate: peak learning rate (AdamW: the per-step recipes,
      `RATE_SCALED`, get `RECIPE_RATE_SCALE` times it).
    momentum: SGD momentum (applied after aggregation). Momentum on top of
      error feedback amplifies the stale residual bursts: at density 0.001
      on digits, 0.9 diverges (70 % accuracy after 500 steps) where plain
      SGD at a higher rate matches dense. `TWO_BIT` runs the momentum-SGD
      recipe instead (`optimizer_for`).
    warmup_steps: linear learning-rate warm-up steps (0: none).
    density_warmup: steps per level of a DGC-style density warm-up
      (`exdyna_jax.dgc_warmup`: 25 %, then a quarter of it per level down to
      ``density``; 0: none). `TWO_BIT` always warms up, from its own first
      level, 10 steps a level unless this gives them.
    value_dtype: the dtype the sparsifier sums the exchanged values in
      (``"float32"``, ``"bfloat16"``, ``"float16"``).
    network: ``(message_seconds, bytes_per_second)`` of the workers' network,
      for ExDyna's ``network`` option (`exdyna_jax.Network`), or
      ``"measure"``: timed on the mesh before training
      (`with_measured_network`); None: not told. Other methods ignore it.
    eval_every: evaluate on held-out data every this many steps.
    seed: seed of the parameters and of the batches (the same for every
      method, so runs differ only in the exchange).
    optimizer: ``"sgd"`` (``learning_rate``, ``momentum``, a linear warm-up)
      or ``"adamw"`` (peak ``learning_rate`` on a warm-up-cosine schedule,
      weight decay 0.01, each worker's gradient clipped to norm 1; after a
      sparsifier as `exdyna_jax.sparse_adamw`).
    sync_every: 1: every method exchanges every step. ``H > 1``: every
      method but ``dense`` runs `exdyna_jax.local_steps` (``H`` local steps
      of the optimizer, the method exchanging the pseudo-gradient at
      ``density``); ``dense`` stays the per-step baseline.
    value_bits: `exdyna_jax.chunked_topk`'s values in this many bits (8,
      4, 2 or 1) on a scale per chunk; None: in ``value_dtype``. Other
      methods ignore it.
    wire: `exdyna_jax.chunked_topk`'s wire, ``"all_gather"`` or
      ``"all_reduce"`` (every element: ``density`` 1.0 and ``value_bits``;
      the owners' means go in ``value_bits`` too). Other methods ignore it.
  """

  steps: int = 500
  density: float = 0.01
  batch_per_worker: int = 32
  learning_rate: float = 0.3
  momentum: float = 0.0
  warmup_steps: int = 0
  density_warmup: int = 0
  value_dtype: str = "float32"
  network: tuple[float, float] | str | None = None
  eval_every: int = 25
  seed: int = 0
  optimizer: str = "sgd"
  sync_every: int = 1
  value_bits: int | None = None
  wire: str = "all_gather"


def with_measured_network(config: TrainConfig, mesh: jax.sharding.Mesh) -> TrainConfig:
  """``config`` with ``network="measure"`` replaced by `exdyna_jax.Network.measure` on ``mesh``.

  Every process must call it (it runs collectives); they all get the same
  figures.
  """
  if config.network != "measure":
    return config
  measured = exdyna_jax.Network.measure(mesh, AXIS)
  return dataclasses.replace(config, network=(measured.message_seconds, measured.bytes_per_second))


def density_of(config: TrainConfig) -> float | dict[int, float]:
  """The ``density`` a sparsifier gets: a number, or the warm-up schedule."""
  if config.density_warmup > 0:
    return exdyna_jax.dgc_warmup(config.density, steps_per_level=config.density_warmup)
  return config.density


TOPK_UNION = "topk_union"
"""The demo's name for the float32 AdamW recipe, ``topk(density / n, exact=False)``: each of the
``n`` workers sends its own largest ``density / n`` of ``N`` (a steered threshold), so
their union sends about ``density``."""

TWO_BIT = "chunked_topk_2bit"
"""The demo's name for the 2-bit AdamW recipe, ``chunked_topk(dgc_warmup(TWO_BIT_SHARE * density
/ n, steps_per_level=10, start=0.125), value_bits=2)``: each worker sends six times its share of
``density`` in 2-bit values, about the bytes of `TOPK_UNION`'s float32 ones, after a density
warm-up (`two_bit_density`)."""

TWO_BIT_SHARE = 6
"""How many shares of ``density`` each worker of `TWO_BIT` picks."""

TWO_BIT_WARMUP_START = 0.125
"""Each worker's density in the first level of `TWO_BIT`'s warm-up."""

TWO_BIT_WARMUP_STEPS = 10
"""Steps a level of `TWO_BIT`'s warm-up, unless ``density_warmup`` gives them."""

SHARED_DENSITY = (TOPK_UNION, TWO_BIT)
"""The demo's own names, not registered methods: the recipes whose ``density`` the workers
share out (`per_worker`), so the ``k`` a step asks is their workers' together."""

RATE_SCALED = (*SHARED_DENSITY, "chunked_topk")
"""The AdamW recipes that run at `RECIPE_RATE_SCALE` times the rate when they exchange
every step (`TOPK_UNION`, `TWO_BIT`; ``chunked_topk``, best with ``value_bits=2``)."""

RECIPE_RATE_SCALE = 2.0
"""Under AdamW, per step, `RATE_SCALED` run at this times the peak rate the others get,
as docs/usage.md advises for the recipes ("Momentum and Adam with a sparsifier")."""


def demo_methods() -> tuple[str, ...]:
  """The names the demo trains: the registered methods, `TOPK_UNION` and `TWO_BIT`."""
  return (*exdyna_jax.available_sparsifiers(), *SHARED_DENSITY)


def per_worker(density: float | dict[int, float], num_workers: int,
               shares: int = 1) -> float | dict[int, float]:
  """``shares`` times ``density`` (a number or a schedule) over ``num_workers``, at most 1."""
  if isinstance(density, dict):
    return {step: min(1.0, shares * level / num_workers) for step, level in density.items()}
  return min(1.0, shares * density / num_workers)


def two_bit_density(config: TrainConfig, num_workers: int) -> float | dict[int, float]:
  """`TWO_BIT`'s density: each worker's `TWO_BIT_SHARE` shares, warmed up from
  `TWO_BIT_WARMUP_START` down by 4 a level (`exdyna_jax.dgc_warmup`) where they are below it."""
  share = per_worker(config.density, num_workers, TWO_BIT_SHARE)
  if share >= TWO_BIT_WARMUP_START:
    return share
  steps = config.density_warmup or TWO_BIT_WARMUP_STEPS
  return exdyna_jax.dgc_warmup(share, steps_per_level=steps, start=TWO_BIT_WARMUP_START)


def density_for(method: str, config: TrainConfig, num_workers: int = 1) -> float | dict[int, float]:
  """The ``density`` (a number or a schedule) ``method``'s sparsifier is built with: `TWO_BIT`'s
  own (`two_bit_density`), any other's `density_of` (`TOPK_UNION` shares it out)."""
  if method.lower() == TWO_BIT:
    return two_bit_density(config, num_workers)
  return density_of(config)


def warmup_steps(method: str, config: TrainConfig, num_workers: int = 1) -> int:
  """The steps ``method`` (a name of `demo_methods`) takes before its last density level:
  its density warm-up (0 without one); under local steps the compressor's levels count syncs."""
  if method.lower() == "dense":
    return 0
  density = density_for(method, config, num_workers)
  return max(density) * config.sync_every if isinstance(density, dict) else 0


def sparsifier_for(method: str, config: TrainConfig,
                   num_workers: int = 1) -> optax.GradientTransformationExtraArgs:
  """The sparsifier of ``method`` (a name of `demo_methods`) under ``config``.

  ``dense`` takes no option; ``config.network`` goes to ExDyna only,
  ``config.value_bits`` and ``config.wire`` to ``chunked_topk`` only;
  ``num_workers`` shares the density out for `TOPK_UNION` and `TWO_BIT`.
  """
  name, density = method.lower(), density_for(method, config, num_workers)
  if name == "dense":
    return exdyna_jax.get_sparsifier("dense", axis_name=AXIS)
  options = {} if config.value_dtype == "float32" else {"value_dtype": config.value_dtype}
  if name == TOPK_UNION:
    return exdyna_jax.topk(per_worker(density, num_workers), exact=False, axis_name=AXIS,
                           **options)
  if name == TWO_BIT:
    return exdyna_jax.chunked_topk(density, value_bits=2, axis_name=AXIS, **options)
  if name == "exdyna" and config.network is not None:
    options["network"] = exdyna_jax.Network(*map(float, config.network))
  if name == "chunked_topk":
    options.update(value_bits=config.value_bits, wire=config.wire)
    if config.wire == "all_reduce":
      options["mean_bits"] = config.value_bits
  return exdyna_jax.get_sparsifier(method, density=density, axis_name=AXIS, **options)


ADAMW_WEIGHT_DECAY, ADAMW_CLIP = 0.01, 1.0
SGD_RECIPE_CLIP = 1.0
"""The global norm the momentum-SGD recipe clips each worker's gradient to."""


def optimizer_for(method: str, config: TrainConfig,
                  num_workers: int = 1) -> optax.GradientTransformation:
  """The optimizer of ``method`` under ``config``, its sparsifier on local gradients.

  SGD: ``chain(sparsifier, sgd)``; `TWO_BIT` with momentum ``m`` runs the
  momentum-SGD recipe, ``chain(clip, sparsifier, sgd(lr / (1 - m)))``.
  AdamW: ``chain(dense(), clip, adamw)`` for ``dense``, ``chain(clip,
  sparse_adamw(sparsifier, ...))`` for the others. With ``config.sync_every >
  1`` every method but ``dense`` runs local steps of the optimizer, the
  sparsifier exchanging pseudo-gradients.
  ``num_workers``: the workers `TOPK_UNION` and `TWO_BIT` share the density among. Under
  AdamW, per step, the peak rate of `RATE_SCALED` is `RECIPE_RATE_SCALE`
  times ``config.learning_rate``.
  """
  sparsifier = sparsifier_for(method, config, num_workers)
  local = config.sync_every > 1 and method.lower() != "dense"
  if config.optimizer == "adamw":
    peak = config.learning_rate
    if method.lower() in RATE_SCALED and not local:
      peak *= RECIPE_RATE_SCALE
    learning_rate = optax.warmup_cosine_decay_schedule(
        0.0, peak, config.warmup_steps, max(config.steps, config.warmup_steps + 1), peak / 10)
    clip = optax.clip_by_global_norm(ADAMW_CLIP)
    adamw = optax.chain(clip, optax.adamw(learning_rate, weight_decay=ADAMW_WEIGHT_DECAY))
    if local:
      return exdyna_jax.local_steps(adamw, sync_every=config.sync_every, compressor=sparsifier)
    if method.lower() == "dense":
      return optax.chain(sparsifier, adamw)
    return optax.chain(clip, exdyna_jax.sparse_adamw(sparsifier, learning_rate,
                                                     weight_decay=ADAMW_WEIGHT_DECAY))
  recipe = method.lower() == TWO_BIT and config.momentum > 0 and not local
  # No trace without momentum, nor in the recipe: its state would cost a step a pass over N
  # (and, on XLA:CPU, copies of the largest leaves when the update is ExDyna's).
  momentum = None if recipe else config.momentum or None
  peak = config.learning_rate / (1 - config.momentum) if recipe else config.learning_rate
  learning_rate: float | optax.Schedule = peak
  if config.warmup_steps > 0:
    learning_rate = optax.linear_schedule(0.0, peak, config.warmup_steps)
  sgd = optax.sgd(learning_rate, momentum=momentum)
  if local:
    return exdyna_jax.local_steps(sgd, sync_every=config.sync_every, compressor=sparsifier)
  if recipe:  # the momentum-SGD recipe: clipped first, the residual for the momentum
    return optax.chain(optax.clip_by_global_norm(SGD_RECIPE_CLIP), sparsifier, sgd)
  return optax.chain(sparsifier, sgd)


