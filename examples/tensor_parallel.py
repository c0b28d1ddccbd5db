"""Tensor-parallel Flax NNX on a ``("data", "model")`` mesh, sparsified over ``"data"`` only.

Trains an NNX MLP on scikit-learn's bundled digits on 8 simulated CPU devices
laid out as 4 data-parallel workers of 2 model shards each (``jax.make_mesh``'s
default Explicit axes), once with ``dense`` and once with ExDyna between the 4
workers, and prints test accuracy, the bytes each worker sends over ``"data"``
per step (the library's count) and whether the kernels kept their shardings.

The points to copy:

- the model says how its parameters are split: ``nnx.with_partitioning``,
  Megatron style (the first kernel split by columns over ``"model"``, the
  second by rows), and, on Explicit axes, the sharding of the contraction
  over ``"model"`` (``out_sharding=P()``), as JAX asks there;
- ``exdyna_jax.data_parallel(tx, mesh, axis_name="data")``: the workers are
  the ``"data"`` axis, the other axes stay the model's; ``nnx_optimizer`` and
  ``nnx_step`` as in ``examples/nnx_shard_map.py``. The parameters keep their
  shardings, and each device sparsifies the shards it holds: its residual is
  its own shards' (split over ``"model"``), exchanged over ``"data"``.

Run: python examples/tensor_parallel.py [--steps 300] [--density 0.01] [--method exdyna]
"""

from __future__ import annotations

import argparse
import pathlib
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax import P

import exdyna_jax

import _common

SHARDED_KERNELS = {"hidden": P(None, "model"), "proj": P("model", None)}


class MLP(nnx.Module):
  """64 -> 256 (columns over "model") -> 256 (rows over "model") -> 10, ReLU."""

  def __init__(self, rngs: nnx.Rngs):
    init = nnx.initializers.lecun_normal()
    self.hidden = nnx.Linear(64, 256, rngs=rngs,
                             kernel_init=nnx.with_partitioning(init, (None, "model")),
                             bias_init=nnx.with_partitioning(nnx.initializers.zeros, ("model",)))
    self.proj = nnx.Linear(256, 256, rngs=rngs,
                           kernel_init=nnx.with_partitioning(init, ("model", None)))
    self.output = nnx.Linear(256, 10, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = jax.nn.relu(self.hidden(x))  # each model shard holds its 128 columns
    x = jnp.matmul(x, self.proj.kernel[...], out_sharding=P()) + self.proj.bias[...]
    return self.output(jax.nn.relu(x))


def loss_fn(model: MLP, x: jax.Array, y: jax.Array) -> jax.Array:
  return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


def kernel_specs(model: MLP) -> dict[str, P]:
  return {name: getattr(model, name).kernel[...].sharding.spec for name in SHARDED_KERNELS}


def train(method: str, args: argparse.Namespace, mesh: jax.sharding.Mesh,
          split: _common.Split, out_dir: pathlib.Path) -> dict[str, Any]:
  """Trains a fresh model with ``method``; returns its row of the table."""
  with jax.set_mesh(mesh):  # with_partitioning places each parameter on the mesh
    model = MLP(nnx.Rngs(args.seed))
  options = {} if method == "dense" else {"density": args.density}
  tx = optax.chain(exdyna_jax.get_sparsifier(method, **options), optax.sgd(args.learning_rate))
  dp = exdyna_jax.data_parallel(tx, mesh, axis_name="data")
  optimizer = exdyna_jax.nnx_optimizer(dp, model, wrt=nnx.Param)

  @exdyna_jax.nnx_step(dp)  # every worker: its shard of the batch, its own optimizer state
  def train_step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
    optimizer.update(model, grads)
    return loss

  rng = np.random.default_rng(args.seed)
  global_batch = mesh.shape["data"] * args.batch_per_worker
  records, losses = [], []
  for t in range(1, args.steps + 1):
    idx = rng.integers(0, len(split.x_train), global_batch)
    losses.append(float(np.mean(train_step(model, optimizer, split.x_train[idx],
                                           split.y_train[idx]))))
    stats = dp.stats(optimizer.opt_state)
    records.append({"step": t, "loss": losses[-1], "bytes_sent": int(stats.bytes_sent)})
  _common.write_json_lines(out_dir / f"metrics-{method}.jsonl", records)

  with jax.set_mesh(mesh):
    accuracy = float(np.mean(np.argmax(model(split.x_test), -1) == split.y_test))
  return {"method": method, "test_accuracy": f"{accuracy:.2%}",
          "first_loss": f"{losses[0]:.3f}", "last_loss": f"{np.mean(losses[-10:]):.3f}",
          "bytes/worker/step over data": int(stats.bytes_sent),
          "shardings kept": kernel_specs(model) == SHARDED_KERNELS}


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
  args = _common.example_parser(__doc__.split("\n\n")[0], "runs/tensor_parallel").parse_args(argv)
  mesh = jax.make_mesh((4, 2), ("data", "model"))  # Explicit axes: JAX's default
  split = _common.load_digits_split()
  return _common.compare(lambda method: train(method, args, mesh, split, args.out),
                         args.method, args.out)


if __name__ == "__main__":
  jax.config.update("jax_num_cpu_devices", 8)  # before JAX starts its backend
  main()
