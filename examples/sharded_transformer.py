"""A miniGPT-style transformer with sharded parameters, sparsified across the replicas only.

The model is the JAX AI Stack's miniGPT pretraining tutorial's, shrunk to run on
8 simulated CPU devices: token and position embeddings, pre-norm blocks of causal
self-attention and an MLP (Flax NNX), AdamW with gradient clipping and a
warm-up-cosine schedule, on Python's help topics read as bytes (nothing is
downloaded). ``--mesh`` lays the 8 devices out in one of two ways:

- ``tp``, ``("data", "model")`` 4 x 2: tensor parallel, Megatron style. The
  attention heads and the MLP's hidden units are split over ``"model"``
  (``nnx.with_partitioning``); the contractions over ``"model"`` name their
  output's sharding (``out_sharding``), as Explicit axes ask.
- ``hsdp``, ``("data", "fsdp")`` 2 x 4: every parameter split over ``"fsdp"``
  (the fast axis inside a host), gathered where it is used, each replica's
  batch split over ``"fsdp"`` too; XLA reduce-scatters each gradient over
  ``"fsdp"``.

Either way ``exdyna_jax.data_parallel(tx, mesh, axis_name="data")`` makes the
``"data"`` axis the workers (the replicas, across the slow network), and each
device sparsifies the shards it holds and exchanges them over ``"data"`` only:
its residual is its own shards'. Trained once with data-parallel AdamW and once
with the AdamW recipe, ``sparse_adamw(chunked_topk(dgc_warmup(6 * density / n,
...), value_bits=2), 2 * lr)`` on ``n`` replicas (the bytes of ``density`` in
float32 after a 20-step warm-up); prints test loss, the bytes each device sends over ``"data"`` a
step (the library's count), whether every parameter kept its sharding, and
the optimizer state a device holds. The six lines marked ``# exdyna`` are
what porting the tutorial took (its ``nnx.Optimizer`` and ``nnx.jit``
swapped, the sparsifier and the data axis named); the ``out_sharding``
arguments and the gathered weights are what Explicit axes ask of any sharded
model.

Run: python examples/sharded_transformer.py [--mesh tp|hsdp] [--steps 300] [--density 0.01]
"""

from __future__ import annotations

import argparse
import pathlib
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
import optax
from flax import nnx
from jax import P

import exdyna_jax

import _common


class Layout(NamedTuple):
  """Where a mesh puts each kind of parameter, and the activations."""

  shape: tuple[int, int]
  axes: tuple[str, str]
  qkv: P  # [width, heads, head_dim]
  out: P  # [heads, head_dim, width]
  up: P  # [width, 4 width]
  down: P  # [4 width, width]
  vector: P  # embeddings' width, norms, biases of width
  activations: P  # [batch, time, width] inside a worker
  gather: bool  # gather the parameters whole where they are used (FSDP)


LAYOUTS = {
    "tp": Layout((4, 2), ("data", "model"), qkv=P(None, "model", None),
                 out=P("model", None, None), up=P(None, "model"), down=P("model", None),
                 vector=P(), activations=P(), gather=False),
    "hsdp": Layout((2, 4), ("data", "fsdp"), qkv=P("fsdp", None, None),
                   out=P("fsdp", None, None), up=P("fsdp", None), down=P("fsdp", None),
                   vector=P("fsdp"), activations=P("fsdp"), gather=True),
}


def sharded(spec: P):
  """An initializer that places the parameter on ``spec`` (``nnx.with_partitioning``)."""
  return lambda init: nnx.with_partitioning(init, tuple(spec))


class Block(nnx.Module):
  """Pre-norm causal self-attention and a GELU MLP."""

  def __init__(self, width: int, heads: int, layout: Layout, rngs: nnx.Rngs):
    dense, zeros = nnx.initializers.lecun_normal(), nnx.initializers.zeros
    norm = lambda: nnx.LayerNorm(  # noqa: E731
        width, scale_init=sharded(layout.vector)(nnx.initializers.ones),
        bias_init=sharded(layout.vector)(zeros), rngs=rngs)
    self.attention_norm, self.mlp_norm = norm(), norm()
    self.attention = nnx.MultiHeadAttention(
        heads, width, decode=False, kernel_init=sharded(layout.qkv)(dense),
        bias_init=sharded(P(*layout.qkv[1:]))(zeros), out_kernel_init=sharded(layout.out)(dense),
        out_bias_init=sharded(layout.vector)(zeros), rngs=rngs)
    self.up = nnx.Linear(width, 4 * width, kernel_init=sharded(layout.up)(dense),
                         bias_init=sharded(P(layout.up[1]))(zeros), rngs=rngs)
    self.down = nnx.Linear(4 * width, width, kernel_init=sharded(layout.down)(dense),
                           bias_init=sharded(layout.vector)(zeros), rngs=rngs)
    self.activations = layout.activations

  def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
    x = x + self.attention(self.attention_norm(x), mask=mask, out_sharding=self.activations)
    hidden = jax.nn.gelu(self.up(self.mlp_norm(x)))
    return x + self.down(hidden, out_sharding=self.activations)


class MiniGPT(nnx.Module):
  """Token and position embeddings, ``layers`` blocks, the output tied to the embedding."""

  def __init__(self, vocab: int, context: int, width: int, layers: int, heads: int,
               layout: Layout, rngs: nnx.Rngs):
    embedding = sharded(P(None, *layout.vector))
    self.embed = nnx.Embed(vocab, width, embedding_init=embedding(nnx.initializers.normal(0.02)),
                           rngs=rngs)
    self.positions = nnx.Param(jax.random.normal(rngs.params(), (context, width)) * 0.02)
    self.blocks = nnx.List([Block(width, heads, layout, rngs) for _ in range(layers)])
    self.norm = nnx.LayerNorm(width, rngs=rngs)
    self.activations = layout.activations

  def __call__(self, tokens: jax.Array) -> jax.Array:
    embedded = self.embed.embedding[...].at[tokens].get(out_sharding=self.activations)
    x = embedded + self.positions[: tokens.shape[1]]
    mask = nnx.make_causal_mask(tokens)
    for block in self.blocks:
      x = block(x, mask)
    return self.embed.attend(self.norm(x))


def gathered(model: MiniGPT) -> MiniGPT:
  """The model with every parameter gathered whole (HSDP: where it is used, in the step)."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  whole = jax.tree.map(lambda value: jax.sharding.reshard(value, P()), params)
  return nnx.merge(graphdef, whole, rest)


def loss_fn(model: MiniGPT, inputs: jax.Array, targets: jax.Array, gather: bool) -> jax.Array:
  logits = (gathered(model) if gather else model)(inputs)
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def param_specs(model: MiniGPT) -> dict[tuple, P]:
  return {path: leaf.sharding.spec for path, leaf in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def state_bytes_per_device(tree: Any) -> int:
  """What one device holds of ``tree``'s arrays."""
  return sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(tree))


def train(method: str, args: argparse.Namespace, mesh: jax.sharding.Mesh,
          layout: Layout) -> dict[str, Any]:
  """Trains a fresh model with ``method``; returns its row of the table."""
  train_tokens, test_tokens = _common.byte_corpus()
  with jax.set_mesh(mesh):  # with_partitioning places each parameter on the mesh
    model = MiniGPT(128, args.context, args.width, args.layers, args.heads, layout,
                    nnx.Rngs(args.seed))
  specs = param_specs(model)
  def schedule(peak: float) -> optax.Schedule:
    return optax.warmup_cosine_decay_schedule(0.0, peak, max(1, args.steps // 10), args.steps)

  clip = optax.clip_by_global_norm(1.0)
  if method == "dense":  # the baseline: data-parallel AdamW
    tx = optax.chain(clip, exdyna_jax.dense(),
                     optax.adamw(schedule(args.learning_rate), weight_decay=0.01))
  else:  # the AdamW recipe: each replica 6 d / n of the coordinates in 2 bits, twice the rate
    density = exdyna_jax.dgc_warmup(6 * args.density / mesh.shape["data"],  # exdyna
                                    steps_per_level=10, start=0.125)  # ten steps a level
    sparsifier = exdyna_jax.chunked_topk(density, value_bits=2)  # exdyna
    tx = optax.chain(clip, exdyna_jax.sparse_adamw(  # exdyna
        sparsifier, schedule(2 * args.learning_rate), weight_decay=0.01))
  dp = exdyna_jax.data_parallel(tx, mesh, axis_name="data")  # exdyna
  optimizer = exdyna_jax.nnx_optimizer(dp, model, wrt=nnx.Param)  # exdyna

  @exdyna_jax.nnx_step(dp)  # exdyna: every worker its shard of the batch
  def train_step(model, optimizer, inputs, targets):
    inputs, targets = (jax.sharding.reshard(a, layout.activations) for a in (inputs, targets))
    loss, grads = nnx.value_and_grad(loss_fn)(model, inputs, targets, layout.gather)
    optimizer.update(model, grads)
    return loss

  rng, global_batch = np.random.default_rng(args.seed), mesh.shape["data"] * args.batch_per_worker
  records = []
  for step in range(1, args.steps + 1):
    loss = train_step(model, optimizer,
                      *_common.windows(train_tokens, rng, global_batch, args.context))
    records.append({"step": step, "loss": float(np.mean(loss))})
  _common.write_json_lines(args.out / f"metrics-{method}.jsonl", records)
  totals = exdyna_jax.read_totals(dp.stats(optimizer.opt_state))
  test_batch = _common.windows(test_tokens, np.random.default_rng(1234), 64, args.context)
  with jax.set_mesh(mesh):
    test_loss = float(jax.jit(loss_fn, static_argnums=3)(model, *test_batch, layout.gather))
  return {"method": method, "test_loss": f"{test_loss:.3f}",
          "last_loss": f"{np.mean([r['loss'] for r in records[-10:]]):.3f}",
          "bytes/device/step over data": int(totals["bytes_sent"] / args.steps),
          "shardings kept": param_specs(model) == specs,
          "optimizer state/device": state_bytes_per_device(optimizer.opt_state)}


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--mesh", choices=sorted(LAYOUTS), default="tp")
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--density", type=float, default=0.01,
                      help="the bytes of this share of N in float32, all replicas together")
  parser.add_argument("--batch-per-worker", type=int, default=8)
  parser.add_argument("--context", type=int, default=64, help="bytes per window")
  parser.add_argument("--width", type=int, default=128)
  parser.add_argument("--layers", type=int, default=2)
  parser.add_argument("--heads", type=int, default=4)
  parser.add_argument("--learning-rate", type=float, default=3e-3, help="peak, warm-up cosine")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/sharded_transformer"))
  args = parser.parse_args(argv)
  layout = LAYOUTS[args.mesh]
  mesh = jax.make_mesh(layout.shape, layout.axes)  # Explicit axes: JAX's default
  return _common.compare(lambda method: train(method, args, mesh, layout), "chunked_topk", args.out)


if __name__ == "__main__":
  jax.config.update("jax_num_cpu_devices", 8)  # before JAX starts its backend
  main()
