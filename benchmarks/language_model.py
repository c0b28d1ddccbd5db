"""A byte-level transformer language model: what each way of exchanging costs in quality.

The demo's decoder-only transformer (Flax NNX, `exdyna_jax.demo.language_model`)
learns next-byte prediction on text that ships with Python (the help
topics, or with ``--corpus code`` the source of standard modules) on ``--workers`` forced
CPU devices, one worker each, with AdamW, gradient clipping and a
warm-up-cosine schedule. Every variant sees the same batches. Each run
records its test loss (nats per byte) against tokens, the seconds of its
steps, and the bytes each worker sent (the stats' ring-collective count).

Variants (``--variants``, comma-separated; ``:STEPS`` after one runs it
that many steps, its schedule stretched to match; ``@Fxlr`` before that
scales its peak rate by ``F``, e.g. ``sparse_adamw_topk_steered@0.00125@2xlr``):

- ``ddp``: dense all-reduce, ``chain(dense(), clip, adamw)``;
- ``exdyna@D``: per-step ExDyna then AdamW, ``chain(exdyna(D), clip, adamw)``;
- ``sparse_adamw@D``: ``chain(clip, sparse_adamw(exdyna(D), ...))``;
  ``sparse_adamw_chunked_topk@D@2``: values in 2 bits (the values' format
  after the density, as for ``local``); ``@DwL``: ``D`` after a density
  warm-up of ``L`` steps a level from 12.5 % (``dgc_warmup(D,
  steps_per_level=L, start=0.125)``, the recipe's);
- ``diloco@H``: `local_steps` of ``chain(clip, adamw)``, ``dense()``, outer
  Nesterov (0.7, 0.9);
- ``local@H@D``: `local_steps` with ``exdyna(D)`` and the default outer
  step (rate 1); ``local@H@D@bf16``: bfloat16 values (with
  ``chunked_topk``, ``@8``, ``@4``, ``@2``, ``@1``: values in that many bits;
  ``local_chunked_topk@100@1.0@1``: every element in 1 bit, no offsets;
  ``@1ar``: the same on a quantized all-reduce, ``wire="all_reduce"``, the
  owners' means in 2 bits; ``@2ar2``: values and means in 2 bits);
- ``sparse_adamw_dense``: ``sparse_adamw(dense())``, the recipe with nothing
  left out (Adam without momentum on the workers' mean);
- ``sparse_adamw_oracle@D``: ``sparse_adamw`` whose exchange is a dense mean
  followed by the ``D`` largest of it with error feedback on the mean
  (`global_topk_feedback`): what the best selection of ``D`` could give,
  with dense's bytes. A reference, not a method;
- ``topk`` (or ``topk_steered``: ``topk(exact=False)``, ``chunked_topk``, ``cltk``, ``micro``)
  for ``exdyna`` in a name (``topk@D``, ``sparse_adamw_topk@D``,
  ``local_topk@H@D``): that method in the same role. Top-k's density is
  each worker's: ``topk@0.00125`` sends the union of 8 workers' 0.125 %,
  about the indices of ``exdyna@0.01``.

The report (`benchmarks/report/language_model.py`) compares every run with
``ddp``'s final test loss: at equal tokens, and the step, bytes and
alpha-beta network time at which each first reaches it.

Run: python -m benchmarks.language_model [--quick] [--variants ddp,local@30@0.05:900]
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import time
from collections.abc import Sequence

import jax

if __name__ == "__main__":
  jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp
import numpy as np
import optax
from jax.flatten_util import ravel_pytree

import exdyna_jax
from benchmarks import _common
from exdyna_jax.demo.language_model import language_model_task
from exdyna_jax.demo.recipes import TWO_BIT_WARMUP_START
from exdyna_jax.demo.trainer import Task

DEFAULT_VARIANTS = (
    "ddp,sparse_adamw_dense,sparse_adamw_oracle@0.01,sparse_adamw_oracle@0.001,exdyna@0.01,"
    "sparse_adamw@0.01,sparse_adamw_topk_steered@0.00125,exdyna@0.001,"
    "sparse_adamw@0.001,sparse_adamw_topk_steered@0.000125,sparse_adamw_topk_steered@0.00125@2xlr,"
    "diloco@10,diloco@30,local@10@0.25,"
    "local_topk@10@0.05,local@30@0.05,local@30@0.02@bf16,ddp:900,sparse_adamw@0.01:900,"
    "sparse_adamw_topk_steered@0.00125:900,sparse_adamw_topk_steered@0.00125@2xlr:900,"
    "diloco@10:900,local@10@0.25:900"
)


def chunked_topk(density: float, value_dtype: str = "float32", chunk: int = 4096
                 ) -> optax.GradientTransformation:
  """`exdyna_jax.chunked_topk`, its values named as the other compressors' (``bfloat16``)
  or by their bits (``8``, ``4``, ``2``; ``1ar``: one bit on ``wire="all_reduce"``,
  ``2ar2``: two bits, the means in two)."""
  bits, all_reduce, mean_bits = value_dtype.partition("ar")
  if bits.isdigit():
    return exdyna_jax.chunked_topk(
        density, chunk=chunk, value_bits=int(bits),
        wire="all_reduce" if all_reduce else "all_gather",
        mean_bits=int(mean_bits) if mean_bits else None)
  return exdyna_jax.chunked_topk(density, chunk=chunk, value_dtype=value_dtype)


# Compressors by the name's suffix (``exdyna`` where none is given); the first that matches.
COMPRESSORS = {
    "chunked_topk": chunked_topk,
    "topk_steered": functools.partial(exdyna_jax.topk, exact=False),
    "topk": exdyna_jax.topk,
    "cltk": exdyna_jax.cltk,
    "micro": exdyna_jax.micro,
    "exdyna": exdyna_jax.exdyna,
}


def global_topk_feedback(density: float) -> optax.GradientTransformation:
  """The ``density`` largest of the (already exchanged) update, the rest kept for later.

  Error feedback on the workers' mean rather than on each worker's own
  gradient: the selection no sparsifier can make without sending everything.

  Args:
    density: the share of the elements released each step.

  Returns:
    A transformation to chain after ``dense()``; its state is the residual,
    shaped like the updates.
  """

  def update_fn(updates, residual, params=None):
    del params
    accumulated, unravel = ravel_pytree(jax.tree.map(jnp.add, residual, updates))
    k = max(1, round(density * accumulated.size))
    threshold = jax.lax.top_k(jnp.abs(accumulated), k)[0][-1]
    sent = jnp.where(jnp.abs(accumulated) >= threshold, accumulated, 0.0)
    return unravel(sent), unravel(accumulated - sent)

  return optax.GradientTransformation(lambda params: jax.tree.map(jnp.zeros_like, params),
                                      update_fn)


def density_of(spec: str) -> float | dict[int, float]:
  """``"0.0075"`` -> 0.0075; ``"0.0075w10"`` -> the recipe's warm-up to it, ten steps a level."""
  density, _, steps_per_level = spec.partition("w")
  if not steps_per_level:
    return float(density)
  return exdyna_jax.dgc_warmup(float(density), steps_per_level=int(steps_per_level),
                              start=TWO_BIT_WARMUP_START)


def parse_variant(spec: str, default_steps: int) -> tuple[str, list[str], int, float]:
  """``"local@30@0.05@2xlr:900"`` -> ``("local", ["30", "0.05"], 900, 2.0)``."""
  name, _, steps = spec.partition(":")
  kind, *rest = name.split("@")
  scales = [float(arg.removesuffix("xlr")) for arg in rest if arg.endswith("xlr")]
  rest = [arg for arg in rest if not arg.endswith("xlr")]
  return kind, rest, int(steps) if steps else default_steps, scales[-1] if scales else 1.0


def compressor_of(kind: str) -> tuple[str, str]:
  """``"sparse_adamw_topk_steered"`` -> ``("topk_steered", "sparse_adamw")``: the
  compressor the name ends with (`COMPRESSORS`, ExDyna by default) and its role."""
  method = next(name for name in COMPRESSORS if kind.endswith(name) or name == "exdyna")
  return method, kind.removesuffix(f"_{method}")


def optimizer(kind: str, rest: list[str], steps: int, args: argparse.Namespace,
              lr_scale: float = 1.0) -> optax.GradientTransformation:
  """The optimizer a variant names (see the module docstring)."""
  peak = args.learning_rate * lr_scale
  lr = optax.warmup_cosine_decay_schedule(0.0, peak, args.warmup, steps, peak / 10)
  clip = optax.clip_by_global_norm(args.clip)
  adamw = optax.chain(clip, optax.adamw(lr, weight_decay=args.weight_decay))
  method, base = compressor_of(kind)

  def compressor(density: str, values: str = "float32"):
    options = {"chunk": args.chunk} if method == "chunked_topk" else {}
    value_dtype = {"bf16": "bfloat16"}.get(values, values)
    return COMPRESSORS[method](density=density_of(density), value_dtype=value_dtype, **options)

  if base == "ddp":
    return optax.chain(exdyna_jax.dense(), adamw)
  if base == method:
    return optax.chain(compressor(*rest[:2]), adamw)
  if base in ("sparse_adamw", "sparse_adamw_dense", "sparse_adamw_oracle"):
    if kind == "sparse_adamw_dense":
      exchange = exdyna_jax.dense()
    elif kind == "sparse_adamw_oracle":
      exchange = optax.chain(exdyna_jax.dense(), global_topk_feedback(float(rest[0])))
    else:
      exchange = compressor(*rest[:2])
    return optax.chain(clip, exdyna_jax.sparse_adamw(exchange, lr, weight_decay=args.weight_decay))
  if base == "diloco":
    return exdyna_jax.local_steps(
        adamw, sync_every=int(rest[0]), compressor=exdyna_jax.dense(),
        outer=optax.sgd(args.outer_learning_rate, momentum=0.9, nesterov=True))
  if base == "local":
    return exdyna_jax.local_steps(adamw, sync_every=int(rest[0]),
                                  compressor=compressor(*rest[1:3]))
  raise ValueError(f"unknown variant {kind!r}")


def run_variant(spec: str, args: argparse.Namespace, task: Task, mesh: jax.sharding.Mesh
                ) -> dict:
  """Trains one variant from the same initial model on the same batches."""
  kind, rest, steps, lr_scale = parse_variant(spec, args.steps)
  params = task.init_params(jax.random.key(args.seed))
  tx = optimizer(kind, rest, steps, args, lr_scale)
  dp = exdyna_jax.data_parallel(tx, mesh)

  @dp.step
  def train_step(params, opt_state, batch):
    grads = jax.grad(task.loss_fn)(params, *batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  evaluate = jax.jit(lambda params: task.evaluate(params)["test_loss"])
  opt_state = dp.init(params)
  rng = np.random.default_rng(args.seed)
  global_batch = args.batch_per_worker * mesh.size
  curve, seconds = [{"step": 0, "seconds": 0.0, "test_loss": float(evaluate(params))}], 0.0
  for step in range(1, steps + 1):
    batch = task.sample_batch(rng, global_batch)
    start = time.perf_counter()
    params, opt_state = train_step(params, opt_state, batch)
    jax.block_until_ready(params)  # one step at a time: collectives of 8 CPU devices
    elapsed = time.perf_counter() - start
    seconds += 2 * elapsed if step == 2 else elapsed if step > 2 else 0.0  # step 1 compiles
    if step % args.eval_every == 0 or step == steps:
      curve.append({"step": step, "seconds": seconds, "test_loss": float(evaluate(params))})
  totals = exdyna_jax.read_totals(dp.stats(opt_state))
  return {"variant": spec, "steps": steps, "curve": curve,
          "tokens_per_step": global_batch * args.context,
          "exchanges": totals["steps"], "bytes_sent": totals["bytes_sent"],
          "transmitted": totals["transmitted"], "overflow": totals["overflow"],
          "target": totals["target"],
          "seconds": seconds}


def earlier_runs(path: pathlib.Path, config: dict) -> list[dict]:
  """The runs in ``path``, refused unless made with ``config`` (but for the variants)."""
  earlier = json.loads(path.read_text())
  differ = sorted(key for key in {*config, *earlier["config"]} - {"variants"}
                  if config.get(key) != earlier["config"].get(key))
  if differ:
    raise SystemExit(f"--append: {path} was made with other settings ({', '.join(differ)})")
  both = [*earlier["config"]["variants"].split(","), *config["variants"].split(",")]
  config["variants"] = ",".join(dict.fromkeys(both))
  return earlier["runs"]


def main(argv: Sequence[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--variants", default=DEFAULT_VARIANTS)
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--workers", type=int, default=8)
  parser.add_argument("--corpus", choices=("docs", "code"), default="docs",
                      help="Python's help topics (English) or its standard modules' source")
  parser.add_argument("--batch-per-worker", type=int, default=8)
  parser.add_argument("--context", type=int, default=64)
  parser.add_argument("--width", type=int, default=128)
  parser.add_argument("--layers", type=int, default=2)
  parser.add_argument("--heads", type=int, default=4)
  parser.add_argument("--learning-rate", type=float, default=6e-3,
                      help="the peak; ddp's best of 3e-3, 6e-3 and 1.2e-2 at 300 steps")
  parser.add_argument("--outer-learning-rate", type=float, default=0.7)
  parser.add_argument("--chunk", type=int, default=4096, help="chunked_topk's elements a chunk")
  parser.add_argument("--warmup", type=int, default=30)
  parser.add_argument("--weight-decay", type=float, default=0.01)
  parser.add_argument("--clip", type=float, default=1.0)
  parser.add_argument("--eval-every", type=int, default=25)
  parser.add_argument("--test-windows", type=int, default=256)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--quick", action="store_true", help="a few steps of a tiny model")
  parser.add_argument("--append", action="store_true",
                      help="keep the runs already in --out (made with the same settings), "
                      "replacing any variant run again")
  parser.add_argument("--out", type=pathlib.Path, default=_common.RESULTS / "language_model.json")
  args = parser.parse_args(argv)
  if args.quick:
    args.steps, args.warmup, args.eval_every, args.test_windows = 8, 2, 4, 16
    args.width, args.layers, args.heads, args.context = 16, 1, 2, 16
    args.variants = "ddp,local@4@0.1:16"
  task = language_model_task(args.corpus, context=args.context, width=args.width,
                             layers=args.layers, heads=args.heads,
                             test_windows=args.test_windows)
  mesh = _common.mesh_of(args.workers)
  config = {key: value for key, value in vars(args).items()
            if key not in ("out", "quick", "append")}
  payload = {"config": config, "runs": earlier_runs(args.out, config) if args.append else []}
  for spec in args.variants.split(","):
    run = run_variant(spec, args, task, mesh)
    payload["runs"] = [r for r in payload["runs"] if r["variant"] != spec] + [run]
    _common.log(f"{spec:28s} test loss {run['curve'][-1]['test_loss']:.4f}  sent "
                f"{run['bytes_sent'] / 1e6:10.3f} MB  {run['seconds']:7.1f} s")
    _common.write_json(args.out, payload)  # after every run: a long sweep keeps what it has
  return payload


if __name__ == "__main__":
  main()
