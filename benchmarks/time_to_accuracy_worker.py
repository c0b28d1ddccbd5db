"""One process of `benchmarks/cluster.py --time-to-accuracy`: trains on the digits, timed.

Started by ``exdyna_jax.launch`` with shaped links. Trains an MLP
``64-hidden-hidden-10`` on scikit-learn's bundled digits (no download) with
``data_parallel(tx, mesh).step`` for each method in turn. ``dense`` trains
``--steps`` steps and its time (evaluation excluded) is every other
method's budget: each then trains for the same seconds, so their scores
compare at equal seconds, and each curve says when it first reached dense's
final score (the mean of dense's last three evaluations). Process 0 prints
one JSON line per method: ``(seconds, step, test_accuracy)`` points.
"""

from __future__ import annotations

from exdyna_jax import launch

launch.initialize_from_env()

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _cluster_common import (  # noqa: E402
  AXIS,
  barrier,
  data_mesh,
  local_value,
  mlp_logits,
  mlp_params,
  put,
)

import exdyna_jax  # noqa: E402
from exdyna_jax.demo import tasks  # noqa: E402


def make_tx(variant: str, density: float, learning_rate: float, warmup_steps: int):
  """The method, then SGD with momentum; ``*_warmup``: a DGC warm-up of the density."""
  method = variant.removesuffix("_warmup")
  if method != "dense" and variant.endswith("_warmup"):
    density = exdyna_jax.dgc_warmup(density, steps_per_level=warmup_steps)
  options = {} if method == "dense" else {"density": density}
  return optax.chain(exdyna_jax.get_sparsifier(method, axis_name=AXIS, **options),
                     optax.sgd(learning_rate, momentum=0.9))


def train(variant, task, mesh, args, *, budget: float | None):
  """Trains ``args.steps`` steps (``budget`` None) or for ``budget`` seconds; the curve."""
  tx = make_tx(variant, args.density, args.learning_rate, args.warmup_steps)
  dp = exdyna_jax.data_parallel(tx, mesh, axis_name=AXIS)
  replicated = jax.sharding.NamedSharding(mesh, jax.P())
  sharded = jax.sharding.NamedSharding(mesh, jax.P(AXIS))

  def batch_of(inputs, targets):
    return put(inputs, sharded), put(targets.astype(np.int32), sharded)

  params = jax.tree.map(lambda v: put(v, replicated), mlp_params(64, args.hidden))
  opt_state = dp.init(params)

  @dp.step
  def train_step(params, opt_state, batch):
    grads = jax.grad(lambda p: task.loss_fn(p, *batch))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  evaluate = jax.jit(task.evaluate)
  rng = np.random.default_rng(0)  # the same batches on every process and for every method
  batch_size = args.batch * jax.device_count()
  # Compile off the clock: one step on copies (donated), thrown away.
  inputs, targets = task.sample_batch(np.random.default_rng(1), batch_size)
  copies = jax.tree.map(jnp.copy, (params, opt_state))
  jax.block_until_ready(train_step(*copies, batch_of(inputs, targets)))
  evaluate(params)
  curve, seconds, step, done = [], 0.0, 0, False
  while not done:
    batch = batch_of(*task.sample_batch(rng, batch_size))
    start = time.perf_counter()
    params, opt_state = jax.block_until_ready(train_step(params, opt_state, batch))
    seconds += time.perf_counter() - start
    step += 1
    if step % args.eval_every == 0:  # every process decides alike: on the slowest one's clock
      seconds = barrier(mesh, seconds)
      accuracy = float(evaluate(params)["test_accuracy"])
      curve.append((round(seconds, 4), step, accuracy))
      done = step >= args.steps if budget is None else seconds >= budget
  return {"variant": variant, "curve": curve, "steps": step, "seconds": seconds,
          "bytes_sent": int(local_value(dp.stats(opt_state).bytes_sent))}


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--variants", default="dense,exdyna,exdyna_warmup,topk")
  parser.add_argument("--steps", type=int, default=300, help="dense's steps")
  parser.add_argument("--density", type=float, default=0.01)
  parser.add_argument("--hidden", type=int, default=2048)
  parser.add_argument("--batch", type=int, default=32, help="examples per worker")
  parser.add_argument("--learning-rate", type=float, default=0.02)
  parser.add_argument("--warmup-steps", type=int, default=25, help="steps per warm-up level")
  parser.add_argument("--eval-every", type=int, default=10)
  args = parser.parse_args()

  mesh = data_mesh()
  task = tasks.digits_classifier_task("digits", None, mlp_logits)
  variants = args.variants.split(",")
  if variants[0] != "dense":
    raise SystemExit("dense comes first: its time is every other method's budget")
  budget = None
  for variant in variants:
    result = train(variant, task, mesh, args, budget=budget)
    budget = result["seconds"] if budget is None else budget
    if jax.process_index() == 0:
      result.update(processes=jax.process_count(), density=args.density,
                    parameters=sum(v.size for v in jax.tree.leaves(
                        mlp_params(64, args.hidden))))
      print(json.dumps(result), flush=True)


if __name__ == "__main__":
  main()
