"""How closely each threshold controller holds the target density; balance.

Trains a small MLP on scikit-learn's bundled digits with n simulated workers
(jax.vmap with an axis name) and records, at every step, K/k (selected over
target) and the partition workloads, imbalance (max/mean) and overflow, for
the reference and the adaptive controllers of ExDyna and MiCRO.

Two widths of the same MLP: hidden 256 (N = 85k, so k = 85 at d = 0.001:
about 11 elements per worker, where counting noise alone is several percent)
and hidden 1024 (N = 1.1M, k = 1,124 at d = 0.001).

Run: python benchmarks/density_control.py [--steps 600] [--densities 0.01,0.001]
     [--hidden 256,1024] [--out FILE]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits

import exdyna_jax

AXIS = "data"


def init_mlp(key, sizes):
  params = []
  for fan_in, fan_out in itertools.pairwise(sizes):
    key, sub = jax.random.split(key)
    params.append(
      {
        "w": jax.random.normal(sub, (fan_in, fan_out)) * jnp.sqrt(2.0 / fan_in),
        "b": jnp.zeros((fan_out,)),
      }
    )
  return params


def mlp(params, x):
  for layer in params[:-1]:
    x = jax.nn.relu(x @ layer["w"] + layer["b"])
  return x @ params[-1]["w"] + params[-1]["b"]


def loss_fn(params, x, y):
  logits = mlp(params, x)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def run(method_tx, *, steps, workers, batch, hidden=256, seed=0):
  digits = load_digits()
  x = jnp.asarray(digits.data / 16.0, jnp.float32)
  y = jnp.asarray(digits.target)
  params = init_mlp(jax.random.key(seed), [64, hidden, hidden, 10])
  tx = optax.chain(method_tx, optax.sgd(0.05, momentum=0.9))

  def worker_init(_):
    return tx.init(params)

  opt_state = jax.vmap(worker_init, axis_name=AXIS, axis_size=workers)(jnp.arange(workers))

  @jax.jit
  def train_step(params, opt_state, key):
    idx = jax.random.randint(key, (workers, batch), 0, x.shape[0])

    def per_worker(state, idx):
      grads = jax.grad(loss_fn)(params, x[idx], y[idx])
      updates, state = tx.update(grads, state, params)
      return updates, state

    updates, opt_state = jax.vmap(per_worker, axis_name=AXIS)(opt_state, idx)
    updates = jax.tree.map(lambda u: u[0], updates)
    return optax.apply_updates(params, updates), opt_state

  key = jax.random.key(seed + 1)
  trace = {"selected": [], "overflow": [], "imbalance": [], "workloads": [], "threshold": []}
  num_elements = sum(p.size for p in jax.tree.leaves(params))
  for _ in range(steps):
    key, sub = jax.random.split(key)
    params, opt_state = train_step(params, opt_state, sub)
    stats = jax.tree.map(lambda a: np.asarray(a)[0], exdyna_jax.get_stats(opt_state))
    trace["selected"].append(int(stats.selected))
    trace["overflow"].append(int(stats.overflow))
    trace["imbalance"].append(float(stats.imbalance))
    trace["workloads"].append(stats.workloads.tolist())
    trace["threshold"].append(float(stats.threshold))
  return {key: np.asarray(value) for key, value in trace.items()}, num_elements


def summarize(selected, target, start=20):
  """Entry into +-5 % and the error after ``start`` (steps count from 1)."""
  ratio = np.asarray(selected) / target
  error = np.abs(ratio[start:] - 1)
  inside = np.nonzero(np.abs(ratio - 1) <= 0.05)[0]
  outside = np.nonzero(np.abs(ratio - 1) > 0.05)[0]
  return {
    f"median_abs_error_after_{start}": float(np.median(error)),
    f"p90_abs_error_after_{start}": float(np.quantile(error, 0.9)),
    f"fraction_within_5pct_after_{start}": float(np.mean(error <= 0.05)),
    "first_step_within_5pct": int(inside[0]) + 1 if inside.size else None,
    "last_step_outside_5pct": int(outside[-1]) + 1 if outside.size else 0,
    "final_ratio": float(ratio[-1]),
  }


def balance(trace, start=20):
  """Imbalance (max/mean workload) and overflow after ``start`` steps."""
  imbalance = trace["imbalance"][start:]
  overflow = trace["overflow"][start:]
  selected = np.maximum(trace["selected"][start:], 1)
  return {
    f"median_imbalance_after_{start}": float(np.median(imbalance)),
    f"p90_imbalance_after_{start}": float(np.quantile(imbalance, 0.9)),
    f"max_imbalance_after_{start}": float(np.max(imbalance)),
    f"steps_with_overflow_after_{start}": int(np.sum(overflow > 0)),
    f"mean_overflow_fraction_after_{start}": float(np.mean(overflow / selected)),
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--steps", type=int, default=600)
  parser.add_argument("--densities", default="0.01,0.001")
  parser.add_argument("--workers", type=int, default=8)
  parser.add_argument("--batch", type=int, default=32)
  parser.add_argument("--methods", default="exdyna,micro")
  parser.add_argument("--hidden", default="256,1024", help="MLP widths (one run set each)")
  parser.add_argument("--out", default=None, help="JSON with the traces (else summary only)")
  args = parser.parse_args()
  summary, runs = {}, []
  configs = itertools.product(
    (int(h) for h in args.hidden.split(",")),
    (float(d) for d in args.densities.split(",")),
    args.methods.split(","),
    ("reference", "adaptive"),
  )
  for hidden, density, method, controller in configs:
    tx = getattr(exdyna_jax, method)(density, controller=controller)
    trace, num_elements = run(
      tx, steps=args.steps, workers=args.workers, batch=args.batch, hidden=hidden
    )
    target = int(density * num_elements)
    name = f"{method}/{controller}/d={density}/hidden={hidden}"
    summary[name] = {**summarize(trace["selected"], target), **balance(trace)}
    runs.append(
      {
        "method": method,
        "controller": controller,
        "density": density,
        "hidden": hidden,
        "elements": int(num_elements),
        "target": target,
        "summary": summary[name],
        **{key: value.tolist() for key, value in trace.items()},
      }
    )
    print(name, json.dumps(summary[name]), file=sys.stderr, flush=True)
  print(json.dumps(summary, indent=2))
  if args.out:
    import _common

    _common.write_json(
      args.out,
      {
        "benchmark": "density_control",
        "steps": args.steps,
        "workers": args.workers,
        "batch": args.batch,
        "model": "MLP 64-h-h-10 on sklearn digits, SGD 0.05 m=0.9",
        "runs": runs,
      },
    )


if __name__ == "__main__":
  main()
