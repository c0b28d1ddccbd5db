"""A small transformer language model on a character corpus shipped with Python.

The corpus is the text of Python's own help topics (``pydoc_data``), so
nothing is downloaded. The model is a 2-layer decoder-only transformer (flax
linen), trained with ``dense`` and with ExDyna on one worker per device (8
simulated on CPU) by the demo's harness (`exdyna_jax.demo.trainer`: an
explicit ``jax.shard_map`` step on local gradients). Prints the comparison table (test perplexity,
density, bytes per worker per step from the compiled HLO, step time) and
writes per-step metrics and plots.

Plug in your own model the same way: build a `Task` (init, loss, evaluate,
batches) and call `train_method` for each method.

Run: python examples/char_transformer.py [--steps 300] [--density 0.01] [--method exdyna]
"""

from __future__ import annotations

import argparse
import pathlib
from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from exdyna_jax.demo import data, report
from exdyna_jax.demo.trainer import MethodRun, Task, TrainConfig, make_mesh, train_method


class DecoderBlock(nn.Module):
  """Pre-norm causal self-attention and MLP."""

  num_heads: int

  @nn.compact
  def __call__(self, x):
    mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
    x = x + nn.MultiHeadDotProductAttention(num_heads=self.num_heads)(nn.LayerNorm()(x), mask=mask)
    width = x.shape[-1]
    hidden = nn.gelu(nn.Dense(4 * width)(nn.LayerNorm()(x)))
    return x + nn.Dense(width)(hidden)


class CharTransformer(nn.Module):
  """Token and position embeddings, ``num_layers`` blocks, tied output."""

  vocab_size: int
  context: int
  width: int = 64
  num_layers: int = 2
  num_heads: int = 4

  @nn.compact
  def __call__(self, tokens):
    embed = nn.Embed(self.vocab_size, self.width)
    positions = self.param("positions", nn.initializers.normal(0.02),
                           (self.context, self.width))
    x = embed(tokens) + positions[: tokens.shape[1]]
    for _ in range(self.num_layers):
      x = DecoderBlock(self.num_heads)(x)
    return embed.attend(nn.LayerNorm()(x))


def char_lm_task(context: int = 64, width: int = 64, num_layers: int = 2,
                 test_windows: int = 64) -> Task:
  """Next-character prediction on the stdlib corpus, scored by test perplexity."""
  corpus = data.char_corpus()
  model = CharTransformer(corpus.vocab_size, context, width=width, num_layers=num_layers)
  test_x, test_y = data.sample_windows(corpus.test, np.random.default_rng(1234),
                                       test_windows, context)

  def loss_fn(params, inputs, targets):
    logits = model.apply({"params": params}, inputs)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

  def evaluate(params):
    loss = loss_fn(params, test_x, test_y)
    return {"test_perplexity": jnp.exp(loss), "test_loss": loss}

  return Task(
      name="chars",
      init_params=lambda key: model.init(key, jnp.zeros((1, context), jnp.int32))["params"],
      loss_fn=loss_fn,
      evaluate=evaluate,
      sample_batch=lambda rng, batch: data.sample_windows(corpus.train, rng, batch, context),
      higher_is_better=False,
  )


def main(argv: Sequence[str] | None = None) -> list[MethodRun]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--density", type=float, default=0.01)
  parser.add_argument("--method", default="exdyna", help="compared with dense")
  parser.add_argument("--batch-per-worker", type=int, default=8)
  parser.add_argument("--context", type=int, default=64, help="characters per window")
  parser.add_argument("--width", type=int, default=64, help="model width")
  parser.add_argument("--layers", type=int, default=2, help="transformer blocks")
  parser.add_argument("--learning-rate", type=float, default=0.3)
  parser.add_argument("--warmup-steps", type=int, default=20)
  parser.add_argument("--density-warmup", type=int, default=0, metavar="STEPS",
                      help="DGC-style density warm-up, STEPS per level (0: none)")
  parser.add_argument("--value-dtype", default="float32",
                      choices=("float32", "bfloat16", "float16"))
  parser.add_argument("--eval-every", type=int, default=50)
  parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/char_transformer"))
  parser.add_argument("--no-progress", action="store_true")
  args = parser.parse_args(argv)

  args.out.mkdir(parents=True, exist_ok=True)
  config = TrainConfig(
      steps=args.steps, density=args.density, batch_per_worker=args.batch_per_worker,
      learning_rate=args.learning_rate, momentum=0.0, warmup_steps=args.warmup_steps,
      density_warmup=args.density_warmup, value_dtype=args.value_dtype,
      eval_every=args.eval_every,
  )
  mesh = make_mesh(jax.device_count())  # 8 forced CPU devices, or one worker per GPU
  task = char_lm_task(args.context, args.width, args.layers)
  runs = []
  for method in ("dense", args.method):
    writer = report.JsonLinesWriter(args.out / f"metrics-{method}.jsonl")
    progress = None
    if not args.no_progress:
      from tqdm import tqdm

      def progress(steps, name, total):
        return tqdm(steps, desc=name, total=total, unit="step")

    runs.append(train_method(method, task, config, mesh, progress=progress,
                             on_record=writer.write))
    writer.close()
  summaries = [report.summarize(run, runs[0].hlo_bytes) for run in runs]
  table = report.format_table(summaries, "test_perplexity")
  print(f"char transformer, {runs[0].num_elements:,} parameters, {mesh.size} workers\n{table}")
  (args.out / "table.txt").write_text(table + "\n")
  report.plot_runs(runs, "test_perplexity", args.out)
  return runs


if __name__ == "__main__":
  jax.config.update("jax_num_cpu_devices", 8)  # before JAX starts its backend
  main()
