"""The train steps `benchmarks.gpu` times: an MLP with SGD, a GPT-like transformer with AdamW.

Eight workers run under ``vmap`` on the one device, each on its own share
of the batch; ``compute`` has no exchange (the workers' updates are averaged
on the device), every other method is chained before the optimizer, but
``topk_union``: the AdamW recipe, ``sparse_adamw(topk(d / n, exact=False))``
(each worker its own ``d / n`` largest, about ``d`` in all). ``chunked_topk``
sends 2-bit values: its step is what a sync of local steps adds to a step.
"""

from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp
import optax

import exdyna_jax
from benchmarks import _common
from benchmarks._gpu_profile import traced_steps
from benchmarks._gpu_programs import CHUNKED_VALUE_BITS
from benchmarks._gpu_timing import AXIS, WORKERS, method_of, timed_steps, timing, traced_as
from exdyna_jax.demo import tasks

# 25.2M parameters, a multiple of 4: under vmap the 8 workers' residuals are
# the rows of one [8, N] array, and where N is not (10 classes: N % 4 == 2)
# rows 1-7 start off the 16-byte alignment XLA:GPU vectorises by (on an
# H200 the accumulation of this tree took 1.12 ms with 10 classes, 0.58 ms
# with N a multiple of 4). On 8 GPUs each residual is a buffer of its own.
TRAIN_LAYERS = (2048, 4096, 4096, 16)
QUICK_TRAIN_LAYERS = (64, 256, 256, 10)
TRAIN_BATCH = 128  # examples per worker
TRAIN_METHODS = ("compute", "dense", "exdyna", "topk")
GPT = {"layers": 12, "width": 768, "heads": 12, "vocab": 256, "context": 256}
QUICK_GPT = {"layers": 2, "width": 64, "heads": 4, "vocab": 256, "context": 32}
GPT_BATCH = 4  # sequences per worker
GPT_METHODS = (("compute", None), ("dense", None), ("exdyna", 0.001), ("exdyna", 0.01),
               ("topk_union", 0.001), ("topk_union", 0.01))
GPT_LEARNING_RATE = 3e-4


def train_step(name, density, loss, optimizer):
  """``(init, step)``: the 8 workers' jitted ``init(params)`` and train step.

  ``step((params, opt_state), batch)`` donates and returns both. Every
  worker computes its gradient of ``loss(params, batch)`` on its share of
  the batch; ``compute`` has no exchange (the workers' ``optimizer`` updates
  are averaged on the one device, which is not a collective), ``topk_union``
  is the AdamW recipe (``optimizer`` unused), the others chain the method
  with ``optimizer``.
  """
  tx = optimizer
  if name == "topk_union":
    tx = exdyna_jax.sparse_adamw(
        exdyna_jax.topk(density / WORKERS, exact=False, axis_name=AXIS), GPT_LEARNING_RATE)
  elif name != "compute":
    extra = {"value_bits": CHUNKED_VALUE_BITS} if name == "chunked_topk" else {}
    tx = optax.chain(_common.make_tx(method_of(name), density, WORKERS, **extra), tx)

  def per_worker(params, opt_state, batch):
    return tx.update(jax.grad(loss)(params, batch), opt_state, params)

  workers = jax.vmap(per_worker, in_axes=(None, 0, 0), axis_name=AXIS, axis_size=WORKERS)

  def step(carry, batch):
    params, opt_state = carry
    updates, opt_state = workers(params, opt_state, batch)
    # Identical on every worker after the exchange; compute's are averaged here.
    updates = jax.tree.map(lambda u: jnp.mean(u, axis=0), updates)
    return optax.apply_updates(params, updates), opt_state

  init = jax.vmap(lambda params, _: tx.init(params), in_axes=(None, 0), axis_name=AXIS)
  return jax.jit(lambda params: init(params, jnp.arange(WORKERS))), jax.jit(
      step, donate_argnums=0)


def time_train_steps(params, batch, methods, loss, optimizer, repeats, rows=None, save=None,
                     profile=None, profiled=()):
  """Median seconds of the whole 8-worker train step of each ``(name, density)``,
  into ``rows`` (``save()`` after each); the steps labelled in ``profiled`` are
  also traced into ``profile/<label>`` (`traced_steps`, under ``rows["profile"]``)."""
  rows = {} if rows is None else rows
  for name, density in methods:
    label = name if density is None else f"{name}@{density}"
    with traced_as(name):
      init, step = train_step(name, density, loss, optimizer)
      carry = (jax.tree.map(jnp.copy, params), init(params))
      carry, times, queued, _ = timed_steps(functools.partial(step, batch=batch), carry, repeats)
      if profile and label in profiled:
        rows.setdefault("profile", {})[label] = traced_steps(
            f"{profile}/{label}", step, carry, batch)
    rows[label] = timing(times, queued)
    if label != "compute":
      rows[f"{label}_over_compute"] = rows[label]["seconds"] / rows["compute"]["seconds"]
    print(f"train {label}: {1e3 * rows[label]['seconds']:.3f} ms", file=sys.stderr, flush=True)
    if save:
      save()
  return rows


def train_rows(layers, density, repeats):
  """The MLP's train step per `TRAIN_METHODS` (`time_train_steps`, ``optax.sgd``)."""
  params = tasks.init_mlp(jax.random.key(0), layers)
  key_x, key_y = jax.random.split(jax.random.key(1))
  batch = (jax.random.normal(key_x, (WORKERS, TRAIN_BATCH, layers[0])),
           jax.random.randint(key_y, (WORKERS, TRAIN_BATCH), 0, layers[-1]))
  rows = {"parameters": sum(x.size for x in jax.tree.leaves(params)), "layers": list(layers),
          "workers": WORKERS, "batch_per_worker": TRAIN_BATCH, "density": density}
  methods = [(name, None if name in ("compute", "dense") else density) for name in TRAIN_METHODS]
  times = time_train_steps(params, batch, methods, tasks.mlp_loss, optax.sgd(0.01), repeats)
  rows.update({key.replace(f"@{density}", ""): value for key, value in times.items()})
  return rows


def init_gpt(key, layers, width, heads, vocab, context):
  """A GPT-2-like decoder's float32 parameters (no biases; output tied to the embedding)."""
  del heads
  keys = iter(jax.random.split(key, 2 + 4 * layers))

  def normal(shape, scale=0.02):
    return scale * jax.random.normal(next(keys), shape, jnp.float32)

  residual_scale = 0.02 / (2 * layers) ** 0.5
  blocks = [{"norm1": jnp.ones(width), "qkv": normal((width, 3 * width)),
             "out": normal((width, width), residual_scale), "norm2": jnp.ones(width),
             "up": normal((width, 4 * width)), "down": normal((4 * width, width), residual_scale)}
            for _ in range(layers)]
  return {"embed": normal((vocab, width)), "position": normal((context, width)),
          "blocks": blocks, "norm": jnp.ones(width)}


def gpt_loss(params, tokens, heads):
  """Next-token cross-entropy of a `init_gpt` model on int32 ``tokens`` ``[B, T]``."""
  def norm(x, scale):
    return scale * (x - x.mean(-1, keepdims=True)) * jax.lax.rsqrt(x.var(-1, keepdims=True) + 1e-5)

  inputs, targets = tokens[:, :-1], tokens[:, 1:]
  x = params["embed"][inputs] + params["position"][: inputs.shape[1]]
  batch, length, width = x.shape
  for block in params["blocks"]:
    q, k, v = jnp.split(norm(x, block["norm1"]) @ block["qkv"], 3, axis=-1)
    q, k, v = (y.reshape(batch, length, heads, width // heads).astype(jnp.bfloat16)
               for y in (q, k, v))
    attended = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    x = x + attended.reshape(batch, length, width).astype(jnp.float32) @ block["out"]
    x = x + jax.nn.gelu(norm(x, block["norm2"]) @ block["up"]) @ block["down"]
  logits = norm(x, params["norm"]) @ params["embed"].T
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def gpt_rows(config, repeats, rows, save=None, profile=None, profiled=(), methods=GPT_METHODS):
  """The GPT's train step per ``methods`` (`time_train_steps`, ``optax.adamw``), into ``rows``.

  ``compute`` comes first, whether ``methods`` names it or not: the others'
  ratios are to it."""
  params = init_gpt(jax.random.key(0), **config)
  tokens = jax.random.randint(
      jax.random.key(1), (WORKERS, GPT_BATCH, config["context"] + 1), 0, config["vocab"])
  loss = functools.partial(gpt_loss, heads=config["heads"])
  rows.update(parameters=sum(x.size for x in jax.tree.leaves(params)), **config,
              workers=WORKERS, sequences_per_worker=GPT_BATCH)
  methods = [("compute", None), *(m for m in methods if m[0] != "compute")]
  return time_train_steps(params, tokens, methods, loss, optax.adamw(GPT_LEARNING_RATE),
                          repeats, rows=rows, save=save, profile=profile, profiled=profiled)
