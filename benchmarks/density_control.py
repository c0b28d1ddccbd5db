"""Does default ExDyna send the density asked for? Transmitted / k, overflow, balance.

Every run trains (or streams gradients) with n workers simulated by
``jax.vmap(axis_name=)`` and records, each step, what was *sent*: the indices
transmitted over ``k = floor(d N)``, the overflow (elements that passed the
threshold but were not sent), the imbalance (max / mean of the
partitions' pass counts) and the bytes one worker sent. Workloads:

==================  =========================================================
digits_mlp          the demo's MLP (64-256-256-10, N = 85k) on sklearn digits
mlp_1m              the same MLP at hidden 1024 (N = 1.1M)
char_transformer    ``examples/char_transformer.py``'s model (N = 112k)
cnn_1d              a 1-D CNN on the digits read as 64-pixel sequences (three
                    convolutions of width 5, 128-256-256 channels, N = 534k)
positional          Gaussian gradients under a hot spot and a hot tail along
                    the vector (N = 300k), drawn fresh every step
heterogeneous       the same, worker w's gradients scaled by 1 + 0.25 w
==================  =========================================================

``--label`` names the library under test: run it once as is ("after") and
once with ``PYTHONPATH`` pointing at an older checkout ("before"); runs with
the same label in ``--out`` are replaced, the others kept, so the report can
compare both.

Run: python -m benchmarks.density_control [--steps 600] [--label after] [--densities 0.01]
     [--workers 8] [--seed 0] [--workloads digits_mlp,...]
     [--methods exdyna,micro] [--out FILE]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import exdyna_jax
from benchmarks import _common
from exdyna_jax.demo import data, tasks, trainer

AXIS = "data"
ROOT = pathlib.Path(__file__).resolve().parent.parent

# name -> (densities, what trains): a demo Task with its SGD settings, or a stream.
WORKLOADS = {
  "digits_mlp": ((0.01,), "task"),
  "mlp_1m": ((0.01, 0.001), "task"),
  "char_transformer": ((0.01, 0.001), "task"),
  "cnn_1d": ((0.01, 0.001), "task"),
  "positional": ((0.01, 0.001), "stream"),
  "heterogeneous": ((0.01,), "stream"),
}
STREAM_ELEMENTS = 300_000


def _char_task():
  """``examples/char_transformer.py``'s model as a demo task: next byte, test perplexity."""
  path = ROOT / "examples" / "char_transformer.py"
  spec = importlib.util.spec_from_file_location("char_transformer", path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # its dataclasses look their module up
  sys.path.insert(0, str(path.parent))  # its `import _common`
  spec.loader.exec_module(module)
  context, corpus = 64, data.char_corpus()
  model = module.CharTransformer(context)
  test_x, test_y = data.sample_windows(corpus.test, np.random.default_rng(1234), 64, context)

  def loss_fn(params, inputs, targets):
    logits = model.apply({"params": params}, inputs)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

  def evaluate(params):
    loss = loss_fn(params, test_x, test_y)
    return {"test_perplexity": jnp.exp(loss), "test_loss": loss}

  return trainer.Task(
      name="chars",
      init_params=lambda key: model.init(key, jnp.zeros((1, context), jnp.int32))["params"],
      loss_fn=loss_fn,
      evaluate=evaluate,
      sample_batch=lambda rng, batch: data.sample_windows(corpus.train, rng, batch, context),
      higher_is_better=False,
  )


def cnn_task():
  """A 1-D CNN on the digits, each image read as a sequence of 64 pixels.

  The data, batches, loss and score are the digits MLP's
  (`tasks.digits_classifier_task`); only the model differs.
  """
  widths = ((1, 128), (128, 256), (256, 256))

  def init_params(key):
    keys = jax.random.split(key, len(widths) + 1)
    params = {
      f"conv{i}": {
        "w": jax.random.normal(k, (5, c_in, c_out)) * jnp.sqrt(2.0 / (5 * c_in)),
        "b": jnp.zeros((c_out,)),
      }
      for i, (k, (c_in, c_out)) in enumerate(zip(keys[:-1], widths, strict=True))
    }
    params["dense"] = {"w": jax.random.normal(keys[-1], (16 * 256, 10)) / 64.0,
                       "b": jnp.zeros((10,))}
    return params

  def logits(params, x):
    h = x.reshape(x.shape[0], 64, 1)
    for i in range(len(widths)):
      layer = params[f"conv{i}"]
      h = jax.lax.conv_general_dilated(
        h, layer["w"], (1,), "SAME", dimension_numbers=("NWC", "WIO", "NWC")
      )
      h = jax.nn.relu(h + layer["b"])
      if i:  # halve the length after the second and third convolutions
        h = h.reshape(h.shape[0], h.shape[1] // 2, 2, h.shape[2]).max(axis=2)
    return h.reshape(h.shape[0], -1) @ params["dense"]["w"] + params["dense"]["b"]

  return tasks.digits_classifier_task("cnn_1d", init_params, logits)


def task_of(name):
  """``(task, batch per worker, optimizer after the sparsifier)``."""
  if name == "digits_mlp":
    return tasks.digits_task(), 32, optax.sgd(0.05, momentum=0.9)
  if name == "mlp_1m":
    return tasks.digits_task((64, 1024, 1024, 10)), 32, optax.sgd(0.05, momentum=0.9)
  if name == "char_transformer":
    schedule = optax.linear_schedule(0.0, 0.3, 20)
    return _char_task(), 8, optax.sgd(schedule)
  if name == "cnn_1d":
    return cnn_task(), 32, optax.sgd(0.02, momentum=0.9)
  raise ValueError(name)


def train(sparsifier, workload, *, steps, workers, seed=0):
  """Trains a demo task; returns the per-step stats of worker 0 and ``N``."""
  task, batch, optimizer = task_of(workload)
  params = task.init_params(jax.random.key(seed))
  tx = optax.chain(sparsifier, optimizer)
  opt_state = jax.vmap(lambda _: tx.init(params), axis_name=AXIS, axis_size=workers)(
    jnp.arange(workers)
  )

  @jax.jit
  def step(params, opt_state, inputs, targets):
    def per_worker(state, x, y):
      grads = jax.grad(task.loss_fn)(params, x, y)
      return tx.update(grads, state, params)

    updates, opt_state = jax.vmap(per_worker, axis_name=AXIS)(opt_state, inputs, targets)
    params = optax.apply_updates(params, jax.tree.map(lambda u: u[0], updates))
    return params, opt_state, jax.tree.map(lambda s: s[0], exdyna_jax.get_stats(opt_state))

  rng = np.random.default_rng(seed)
  records = []
  for _ in range(steps):
    inputs, targets = task.sample_batch(rng, workers * batch)
    inputs = inputs.reshape(workers, batch, *inputs.shape[1:])
    targets = targets.reshape(workers, batch, *targets.shape[1:])
    params, opt_state, stats = step(params, opt_state, inputs, targets)
    records.append(jax.device_get(stats))
  metrics = {name: float(value) for name, value in jax.jit(task.evaluate)(params).items()}
  return records, sum(x.size for x in jax.tree.leaves(params)), metrics


def positional_profile(num_elements):
  position = np.arange(num_elements) / num_elements
  return 0.2 + 3 * np.exp(-(((position - 0.3) / 0.02) ** 2)) + 2 * (position > 0.9)


def stream(sparsifier, workload, *, steps, workers, seed=0):
  """Feeds fresh positional-profile gradients every step; stats of worker 0."""
  profile = jnp.asarray(positional_profile(STREAM_ELEMENTS), jnp.float32)
  worker_scale = 1 + (0.25 if workload == "heterogeneous" else 0.0) * jnp.arange(workers)
  params = jnp.zeros(STREAM_ELEMENTS)

  def per_worker(key, scale):
    def step(state, t):
      grads = scale * profile * jax.random.normal(jax.random.fold_in(key, t), profile.shape)
      _, state = sparsifier.update(grads, state, params)
      return state, exdyna_jax.get_stats(state)

    return jax.lax.scan(step, sparsifier.init(params), jnp.arange(steps))[1]

  keys = jax.random.split(jax.random.key(seed), workers)
  run = jax.jit(jax.vmap(per_worker, axis_name=AXIS, axis_size=workers))
  stats = jax.device_get(jax.tree.map(lambda s: s[0], run(keys, worker_scale)))
  records = [jax.tree.map(lambda s, i=i: s[i], stats) for i in range(steps)]
  return records, STREAM_ELEMENTS, {}


def summarize(trace, target, start=20):
  """What the user gets after ``start`` steps: sent density error, overflow, balance."""
  sent = np.asarray(trace["transmitted"][start:]) / target
  error = np.abs(sent - 1)
  overflow = np.asarray(trace["overflow"][start:]) / target
  imbalance = np.asarray(trace["imbalance"][start:])
  inside = np.nonzero(np.abs(np.asarray(trace["transmitted"]) / target - 1) <= 0.05)[0]
  return {
    "median_sent_over_k": float(np.median(sent)),
    "median_abs_sent_error": float(np.median(error)),
    "p90_abs_sent_error": float(np.quantile(error, 0.9)),
    "first_step_within_5pct": int(inside[0]) + 1 if inside.size else None,
    "mean_overflow_over_k": float(np.mean(overflow)),
    "p90_overflow_over_k": float(np.quantile(overflow, 0.9)),
    "median_imbalance": float(np.median(imbalance)),
    "p90_imbalance": float(np.quantile(imbalance, 0.9)),
    "median_selected_over_k": float(np.median(np.asarray(trace["selected"][start:]) / target)),
    "bytes_sent": int(np.median(trace["bytes_sent"])),
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--steps", type=int, default=600)
  parser.add_argument("--workers", type=int, default=8)
  parser.add_argument("--workloads", default=",".join(WORKLOADS))
  parser.add_argument("--methods", default="exdyna")
  parser.add_argument("--label", default="after", help="names the library version under test")
  parser.add_argument("--seed", type=int, default=0, help="parameters, batches and streams")
  parser.add_argument("--densities", default=None,
                      help="comma-separated, of those each workload lists (default: all)")
  parser.add_argument("--out", default=None, help="JSON to merge the runs into")
  args = parser.parse_args()
  chosen = None if args.densities is None else {float(d) for d in args.densities.split(",")}
  runs = []
  for workload in args.workloads.split(","):
    densities, kind = WORKLOADS[workload]
    for density in densities:
      if chosen is not None and density not in chosen:
        continue
      for method in args.methods.split(","):
        start = time.perf_counter()
        sparsifier = exdyna_jax.get_sparsifier(method, density=density, axis_name=AXIS)
        fn = train if kind == "task" else stream
        records, num_elements, metrics = fn(
          sparsifier, workload, steps=args.steps, workers=args.workers, seed=args.seed
        )
        target = int(density * num_elements)
        fields = ("selected", "transmitted", "overflow", "imbalance", "threshold", "bytes_sent")
        trace = {f: [getattr(r, f).item() for r in records] for f in fields}
        run = {
          "label": args.label,
          "workload": workload,
          "method": method,
          "density": density,
          "workers": args.workers,
          "seed": args.seed,
          "elements": int(num_elements),
          "target": target,
          "metrics": metrics,
          "summary": summarize(trace, target),
          "seconds": time.perf_counter() - start,
          **trace,
        }
        runs.append(run)
        print(f"{args.label} {workload} {method} d={density}: {json.dumps(run['summary'])}",
              file=sys.stderr, flush=True)
  if args.out:
    path = pathlib.Path(args.out)
    kept = []
    if path.exists():
      previous = json.loads(path.read_text())
      kept = [r for r in previous.get("runs", []) if r.get("label") and r["label"] != args.label]
      for run in kept:  # runs from before the script recorded their worker count
        run.setdefault("workers", previous["workers"])
    _common.write_json(
      args.out,
      {
        "benchmark": "density_control",
        "steps": args.steps,
        "workers": args.workers,
        "workloads": {name: kind for name, (_, kind) in WORKLOADS.items()},
        "runs": kept + runs,
      },
    )


if __name__ == "__main__":
  main()
