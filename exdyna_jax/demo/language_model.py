"""The demo's language model: a byte-level decoder transformer in Flax NNX.

`language_model_task` trains it on text that ships with Python
(`data.char_corpus`, or `data.code_corpus` with ``corpus="code"``), scored
by the test loss (nats per byte) on held-out windows. The parameters are
the model's ``nnx.Param`` state as a plain tree, so the demo's trainer (and
`benchmarks/language_model.py`) step it like any other.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
from flax import nnx

from exdyna_jax.demo import data
from exdyna_jax.demo.trainer import Task


class Block(nnx.Module):
  """Pre-norm causal self-attention and a GELU MLP."""

  def __init__(self, width: int, heads: int, rngs: nnx.Rngs):
    self.attention_norm = nnx.LayerNorm(width, rngs=rngs)
    self.attention = nnx.MultiHeadAttention(heads, width, decode=False, rngs=rngs)
    self.mlp_norm = nnx.LayerNorm(width, rngs=rngs)
    self.up = nnx.Linear(width, 4 * width, rngs=rngs)
    self.down = nnx.Linear(4 * width, width, rngs=rngs)

  def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
    x = x + self.attention(self.attention_norm(x), mask=mask)
    return x + self.down(jax.nn.gelu(self.up(self.mlp_norm(x))))


class ByteLM(nnx.Module):
  """Token and position embeddings, ``layers`` blocks, output tied to the embedding."""

  def __init__(self, vocab: int, context: int, width: int, layers: int, heads: int,
               rngs: nnx.Rngs):
    self.embed = nnx.Embed(vocab, width, rngs=rngs)
    self.positions = nnx.Param(0.02 * jax.random.normal(rngs.params(), (context, width)))
    self.blocks = nnx.List([Block(width, heads, rngs) for _ in range(layers)])
    self.norm = nnx.LayerNorm(width, rngs=rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    x = self.embed(tokens) + self.positions[: tokens.shape[1]]
    mask = nnx.make_causal_mask(tokens)
    for block in self.blocks:
      x = block(x, mask)
    return self.embed.attend(self.norm(x))


def language_model_task(corpus: str = "docs", *, context: int = 64, width: int = 128,
                        layers: int = 2, heads: int = 4, test_windows: int = 256) -> Task:
  """Next-byte prediction with `ByteLM`, scored by test loss and perplexity.

  Args:
    corpus: ``"docs"`` (Python's help topics) or ``"code"`` (the source of
      standard modules).
    context: bytes per window.
    width: the model's width (``128``, 2 blocks: 0.42M parameters).
    layers: transformer blocks.
    heads: attention heads.
    test_windows: held-out windows the test loss is the mean over.

  Returns:
    The `Task` (``higher_is_better=False``: its first metric is the test loss).
  """
  text = {"docs": data.char_corpus, "code": data.code_corpus}[corpus]()
  graphdef, _ = nnx.split(ByteLM(text.vocab_size, context, width, layers, heads,
                                 nnx.Rngs(0)), nnx.Param)
  test_x, test_y = data.sample_windows(text.test, np.random.default_rng(1234), test_windows,
                                       context)

  def init_params(key: jax.Array):
    model = ByteLM(text.vocab_size, context, width, layers, heads, nnx.Rngs(params=key))
    return nnx.as_pure(nnx.state(model, nnx.Param))

  def loss_fn(params, inputs, targets):
    logits = nnx.merge(graphdef, params)(inputs)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

  def evaluate(params):
    loss = loss_fn(params, test_x, test_y)
    return {"test_loss": loss, "test_perplexity": jax.numpy.exp(loss)}

  return Task(
      name=f"lm-{corpus}",
      init_params=init_params,
      loss_fn=loss_fn,
      evaluate=evaluate,
      sample_batch=lambda rng, batch: data.sample_windows(text.train, rng, batch, context),
      higher_is_better=False,
  )
