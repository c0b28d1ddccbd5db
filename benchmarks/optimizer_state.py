"""The optimizer after the sparsifier: what its state costs the donated step.

Run: python -m benchmarks.optimizer_state [--quick] [--out results/optimizer_state.json]

Times ``data_parallel(tx, mesh).step`` (jitted, params and state donated) on
4 forced CPU devices for ``tx = optax.chain(method, inner)``, with ``method``
dense or ExDyna (d = 0.001) and ``inner`` plain SGD, SGD with momentum 0.9 or
Adam, on the demo's digits MLP widened (64-2048-2048-10, 4.3M parameters, 32
examples per worker). From the compiled step it also reads the temporaries
(``memory_analysis()``) and the ``copy`` ops of gradient-sized arrays (at
least an eighth of the largest leaf's bytes): a trace or a moment after the
sparsifier should cost its own read and write, not copies of the weights.
"""

from __future__ import annotations

import argparse
import statistics

from benchmarks import _common
from exdyna_jax import hlo

INNER = ("sgd", "momentum", "adam")
SIZES = (64, 2048, 2048, 10)
DEVICES, BATCH = 4, 32


def inner_optimizer(name: str):
  import optax

  return {"sgd": lambda: optax.sgd(0.1), "momentum": lambda: optax.sgd(0.1, momentum=0.9),
          "adam": lambda: optax.adam(1e-3)}[name]()


def big_copies(hlo_text: str, min_bytes: int) -> int:
  """``copy`` ops in the entry computation whose result has ``min_bytes`` or more."""
  computations, entry = hlo.parse_module(hlo_text)
  count = 0
  for line in computations[entry]:
    type_text, rest = hlo.split_type(hlo.INSTRUCTION.match(line).group(2).strip())
    count += rest.startswith("copy(") and hlo.shape_bytes(type_text)[0] >= min_bytes
  return count


def time_step(method: str, inner: str, steps: int) -> dict:
  """Median ms of the donated step, its temporaries (MiB) and its big copies."""
  import jax
  import jax.numpy as jnp
  import optax

  import exdyna_jax
  from exdyna_jax.demo import tasks

  mesh = _common.mesh_of(DEVICES)
  sparsifier = exdyna_jax.get_sparsifier(method, **({} if method == "dense" else {"density": 1e-3}))
  tx = optax.chain(sparsifier, inner_optimizer(inner))
  dp = exdyna_jax.data_parallel(tx, mesh)

  @dp.step
  def train_step(params, opt_state, batch):
    grads = jax.grad(tasks.mlp_loss)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  params = tasks.init_mlp(jax.random.key(0), SIZES)
  opt_state = dp.init(params)
  inputs = jax.random.normal(jax.random.key(1), (DEVICES * BATCH, SIZES[0]))
  batch = (inputs, jnp.arange(DEVICES * BATCH, dtype=jnp.int32) % SIZES[-1])
  compiled = train_step.lower(params, opt_state, batch).compile()
  for _ in range(3):
    params, opt_state = jax.block_until_ready(train_step(params, opt_state, batch))
  (params, opt_state), seconds = _common.blocked_seconds(
      lambda carry: train_step(*carry, batch), (params, opt_state), steps)
  largest = max(leaf.nbytes for leaf in jax.tree.leaves(params))
  return {"method": method, "inner": inner,
          "step_ms": round(statistics.median(seconds) * 1e3, 2),
          "temp_mib": round(compiled.memory_analysis().temp_size_in_bytes / 2**20, 1),
          "big_copies": big_copies(compiled.as_text(), largest // 8)}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true", help="3 timed steps")
  parser.add_argument("--steps", type=int, default=15)
  parser.add_argument("--out", default=str(_common.RESULTS / "optimizer_state.json"))
  args = parser.parse_args()
  _common.force_devices(DEVICES)
  clock = _common.Clock()
  rows = []
  for inner in INNER:  # interleaved: each inner optimizer with both methods in turn
    for method in ("dense", "exdyna"):
      rows.append(time_step(method, inner, 3 if args.quick else args.steps))
      _common.log(f"[optimizer_state] {rows[-1]}")
  _common.write_json(args.out, {"config": {"devices": DEVICES, "sizes": SIZES, "batch": BATCH,
                                           "density": 1e-3}, "rows": rows, "seconds": clock()})


if __name__ == "__main__":
  main()
