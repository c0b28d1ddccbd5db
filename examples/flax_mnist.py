"""Flax NNX's MNIST CNN, trained data parallel with ExDyna.

The single-device NNX training script as Flax's MNIST example writes it (a
CNN with BatchNorm and Dropout, ``nnx.Optimizer``, ``nnx.MultiMetric``,
``@nnx.jit`` steps that mutate their objects), ported to 8 workers. The lines
marked ``# data parallel`` are all that changed; everything else is the
single-device script:

- a mesh, and ``exdyna_jax.sparse_adamw(chunked_topk(dgc_warmup(6 * density / 8,
  ...), value_bits=2), lr)`` for ``optax.adamw(lr, momentum)`` (the library's
  AdamW recipe: each worker sends its own largest ``6 density / 8`` of every
  4,096 coordinates in 2 bits, the bytes of about ``density`` in float32,
  after ten steps at 12.5 % and ten at 3.1 %;
  each worker's own second moment preconditions its gradient and the
  sparsifier's residual carries the momentum);
- ``exdyna_jax.nnx_optimizer(dp, model, wrt=nnx.Param)`` for
  ``nnx.Optimizer(model, tx, wrt=nnx.Param)`` (its state is each worker's own);
- ``@exdyna_jax.nnx_step(dp, reduce=...)`` for ``@nnx.jit`` on the training
  step: each worker takes its share of the batch and draws its own Dropout
  mask; BatchNorm statistics are averaged over the workers and the metrics'
  totals added up, as ``reduce`` says.

The evaluation step stays ``@nnx.jit``: the model's parameters are the same
on every worker. The data is scikit-learn's bundled 8x8 digits upsampled to
28x28 (no download), so the CNN is MNIST's (824,650 parameters).

Run: python examples/flax_mnist.py [--steps 300] [--density 0.01]
(``--density``: the bytes of that share of the coordinates in float32.)
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Sequence

import jax
import numpy as np
import optax
from flax import nnx

import exdyna_jax  # data parallel

import _common


class CNN(nnx.Module):
  """Two 3x3 convolutions with BatchNorm, average pooling, two dense layers, Dropout."""

  def __init__(self, *, rngs: nnx.Rngs):
    self.conv1 = nnx.Conv(1, 32, kernel_size=(3, 3), rngs=rngs)
    self.batch_norm1 = nnx.BatchNorm(32, rngs=rngs)
    self.dropout1 = nnx.Dropout(rate=0.025)
    self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), rngs=rngs)
    self.batch_norm2 = nnx.BatchNorm(64, rngs=rngs)
    self.avg_pool = functools.partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
    self.linear1 = nnx.Linear(3136, 256, rngs=rngs)
    self.dropout2 = nnx.Dropout(rate=0.025)
    self.linear2 = nnx.Linear(256, 10, rngs=rngs)

  def __call__(self, x, rngs: nnx.Rngs | None = None):
    x = self.avg_pool(nnx.relu(self.batch_norm1(self.dropout1(self.conv1(x), rngs=rngs))))
    x = self.avg_pool(nnx.relu(self.batch_norm2(self.conv2(x))))
    x = x.reshape(x.shape[0], -1)
    x = nnx.relu(self.dropout2(self.linear1(x), rngs=rngs))
    return self.linear2(x)


def loss_fn(model: CNN, rngs: nnx.Rngs, batch):
  logits = model(batch["image"], rngs)
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
  return loss, logits


def train(args: argparse.Namespace) -> dict[str, float]:
  """Trains the CNN for ``args.steps`` steps; returns the last metrics."""
  mesh = jax.make_mesh((jax.device_count(),), ("data",),  # data parallel
                       axis_types=(jax.sharding.AxisType.Auto,))  # data parallel
  model = CNN(rngs=nnx.Rngs(0))
  tx = exdyna_jax.sparse_adamw(exdyna_jax.chunked_topk(exdyna_jax.dgc_warmup(  # data parallel
      6 * args.density / mesh.size, steps_per_level=10, start=0.125),  # data parallel: warm-up
      value_bits=2), args.learning_rate)  # data parallel: the residual is the momentum
  dp = exdyna_jax.data_parallel(tx, mesh)  # data parallel
  optimizer = exdyna_jax.nnx_optimizer(dp, model, wrt=nnx.Param)  # data parallel
  metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))
  rngs = nnx.Rngs(0)

  @exdyna_jax.nnx_step(dp, reduce={nnx.BatchStat: "mean",  # data parallel
                                   nnx.metrics.MetricState: "sum"})  # data parallel
  def train_step(model: CNN, optimizer: nnx.Optimizer, metrics: nnx.MultiMetric,
                 rngs: nnx.Rngs, batch):
    grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
    (loss, logits), grads = grad_fn(model, rngs, batch)
    metrics.update(loss=loss, logits=logits, labels=batch["label"])
    optimizer.update(model, grads)

  @nnx.jit
  def eval_step(model: CNN, metrics: nnx.MultiMetric, rngs: nnx.Rngs, batch):
    loss, logits = loss_fn(model, rngs, batch)
    metrics.update(loss=loss, logits=logits, labels=batch["label"])

  train_ds, test_ds = _common.digit_images()
  order = np.random.default_rng(args.seed)
  history = {}
  for step in range(1, args.steps + 1):
    chosen = order.integers(0, len(train_ds["label"]), args.batch_size)
    model.train()
    train_step(model, optimizer, metrics, rngs, {k: v[chosen] for k, v in train_ds.items()})
    if step % args.eval_every == 0 or step == args.steps:
      history.update({f"train_{k}": float(v) for k, v in metrics.compute().items()})
      metrics.reset()
      model.eval()
      eval_step(model, metrics, rngs, test_ds)
      history.update({f"test_{k}": float(v) for k, v in metrics.compute().items()})
      metrics.reset()
      print(f"step {step:4d}  train loss {history['train_loss']:.3f}  "
            f"test loss {history['test_loss']:.3f}  test accuracy {history['test_accuracy']:.2%}")
  totals = exdyna_jax.read_totals(dp.stats(optimizer.opt_state))  # data parallel
  history["sent_share"] = totals["transmitted"] / (totals["target"] * mesh.size)  # data parallel
  print(f"{mesh.size} workers, sent/k {history['sent_share']:.3f}")  # data parallel: union / picks
  return history


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
  parser = _common.port_parser(__doc__.split("\n\n")[0])
  parser.add_argument("--density", type=float, default=0.01)  # data parallel
  return train(parser.parse_args(argv))


if __name__ == "__main__":
  jax.config.update("jax_num_cpu_devices", 8)  # data parallel: 8 CPU devices if no GPU
  main()
