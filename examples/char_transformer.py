"""A small transformer language model on text that ships with Python, trained data parallel.

The corpus is the text of Python's own help topics (``pydoc_data``), read as
bytes, so nothing is downloaded. The model is a decoder-only transformer
(flax linen), trained on one worker per device (8 simulated on CPU) in a
``data_parallel`` step, once with data-parallel AdamW (``dense()`` then
``optax.adamw``) and once with a sparsifier in
``exdyna_jax.sparse_adamw(sparsifier, lr)``, the AdamW to use after one (each
worker's own second moment, the residual carrying the momentum); each
worker's gradient is clipped first. Prints test
perplexity, the density sent and the bytes each worker sends per step,
counted from the compiled program (`exdyna_jax.hlo`).

Run: python examples/char_transformer.py [--steps 300] [--density 0.01] [--method exdyna]
"""

from __future__ import annotations

import argparse
import pathlib
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import exdyna_jax
from exdyna_jax import hlo

import _common


class DecoderBlock(nn.Module):
  """Pre-norm causal self-attention and MLP."""

  num_heads: int

  @nn.compact
  def __call__(self, x):
    mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
    x = x + nn.MultiHeadDotProductAttention(num_heads=self.num_heads)(nn.LayerNorm()(x), mask=mask)
    hidden = nn.gelu(nn.Dense(4 * x.shape[-1])(nn.LayerNorm()(x)))
    return x + nn.Dense(x.shape[-1])(hidden)


class CharTransformer(nn.Module):
  """Byte embeddings and learned positions, ``num_layers`` blocks, tied output."""

  context: int
  width: int = 64
  num_layers: int = 2
  num_heads: int = 4

  @nn.compact
  def __call__(self, tokens):
    embed = nn.Embed(128, self.width)  # ASCII
    positions = self.param("positions", nn.initializers.normal(0.02), (self.context, self.width))
    x = embed(tokens) + positions[: tokens.shape[1]]
    for _ in range(self.num_layers):
      x = DecoderBlock(self.num_heads)(x)
    return embed.attend(nn.LayerNorm()(x))


def train(method: str, args: argparse.Namespace, mesh: jax.sharding.Mesh) -> dict[str, Any]:
  """Trains a fresh model with ``method``; returns its row of the table."""
  train_tokens, test_tokens = _common.byte_corpus()
  model = CharTransformer(args.context, args.width, args.layers)
  params = model.init(jax.random.key(args.seed), jnp.zeros((1, args.context), jnp.int32))["params"]

  def loss_fn(params, inputs, targets):
    logits = model.apply({"params": params}, inputs)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

  schedule = optax.warmup_cosine_decay_schedule(
      0.0, args.learning_rate, max(1, args.steps // 10), args.steps)
  clip = optax.clip_by_global_norm(1.0)  # each worker clips its own gradient
  if method == "dense":  # the baseline: data-parallel AdamW
    tx = optax.chain(clip, exdyna_jax.dense(), optax.adamw(schedule, weight_decay=1e-4))
  else:  # AdamW for a sparsified exchange
    sparsifier = exdyna_jax.get_sparsifier(method, density=args.density)
    tx = optax.chain(clip, exdyna_jax.sparse_adamw(sparsifier, schedule))
  dp = exdyna_jax.data_parallel(tx, mesh)

  @dp.step  # every worker: its shard of the batch, its own gradient and optimizer state
  def train_step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  rng = np.random.default_rng(args.seed)
  test_batch = _common.windows(test_tokens, np.random.default_rng(1234), 64, args.context)
  opt_state = dp.init(params)
  batch = _common.windows(train_tokens, rng, mesh.size * args.batch_per_worker, args.context)
  hlo_bytes = hlo.bytes_per_worker(
      train_step.lower(params, opt_state, batch).compile().as_text(), mesh.size)
  records = []
  for step in range(1, args.steps + 1):
    params, opt_state, losses = train_step(params, opt_state, batch)
    stats = dp.stats(opt_state)
    records.append({"step": step, "loss": float(np.mean(losses)),
                    "sent_over_k": float(stats.transmitted / stats.target)})
    batch = _common.windows(train_tokens, rng, mesh.size * args.batch_per_worker, args.context)
  _common.write_json_lines(args.out / f"metrics-{method}.jsonl", records)
  test_loss = float(jax.jit(loss_fn)(params, *test_batch))
  return {
      "method": method,
      "test_perplexity": f"{np.exp(test_loss):.3f}",
      "last_loss": f"{np.mean([r['loss'] for r in records[-10:]]):.3f}",
      "sent/k": f"{np.mean([r['sent_over_k'] for r in records]):.3f}",
      "bytes/worker/step (HLO)": hlo_bytes,
      "(stats)": int(stats.bytes_sent),
  }


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--density", type=float, default=0.01)
  parser.add_argument("--method", default="exdyna", help="compared with dense")
  parser.add_argument("--batch-per-worker", type=int, default=8)
  parser.add_argument("--context", type=int, default=64, help="bytes per window")
  parser.add_argument("--width", type=int, default=64, help="model width")
  parser.add_argument("--layers", type=int, default=2, help="transformer blocks")
  parser.add_argument("--learning-rate", type=float, default=3e-3, help="peak, warm-up cosine")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/char_transformer"))
  args = parser.parse_args(argv)
  mesh = _common.worker_mesh()  # 8 forced CPU devices, or one worker per GPU
  return _common.compare(lambda method: train(method, args, mesh), args.method, args.out)


if __name__ == "__main__":
  jax.config.update("jax_num_cpu_devices", 8)  # before JAX starts its backend
  main()
