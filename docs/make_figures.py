"""Makes the figures of "How ExDyna works" from real runs of the library.

Trains the demo's MLP (85,002 parameters) on scikit-learn's bundled digits
with 8 workers simulated by ``jax.vmap(..., axis_name="data")``, each on its
own batches, and records `exdyna_jax.SparsifierStats` after every step:

- ``exdyna_partitions.png``: the partition boundaries of ExDyna over the
  steps (rebalancing) and the partition worker 0 owns (rotation);
- ``exdyna_workloads.png``: the imbalance (largest over mean partition
  workload) of ExDyna and MiCRO, and their per-partition workloads late in
  the run;
- ``exdyna_threshold.png``: indices sent over target (``transmitted / k``)
  and the threshold, for the default (adaptive controller, balanced
  partitions) and the published rules (``controller="reference"``).

Run from the repository root (about a minute on 2 CPU cores)::

  python docs/make_figures.py            # writes docs/_static/*.png

``--smoke --out DIR`` is the check of ``tests/test_docs.py``: 3 steps of
ExDyna only, whose trace stands in for the other runs in every figure.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from typing import Any

import jax
import numpy as np
import optax

import exdyna_jax
from exdyna_jax.demo import tasks

AXIS = "data"
FIGURES = ("exdyna_partitions.png", "exdyna_workloads.png", "exdyna_threshold.png")
DEFAULT_OUT = pathlib.Path(__file__).resolve().parent / "_static"


def run(sparsifier, *, steps: int, workers: int, batch: int, seed: int) -> dict[str, np.ndarray]:
  """Trains the digits MLP; returns worker 0's stats after every step, stacked.

  Args:
    sparsifier: the transform under study; SGD (learning rate 0.3) follows it.
    steps: training steps.
    workers: simulated workers.
    batch: examples per worker per step.
    seed: seed of the parameters and of the batches (the same for every run).

  Returns:
    ``{field: [steps, ...]}`` of `exdyna_jax.SparsifierStats`, plus
    ``"leaf_sizes"`` (elements of each gradient leaf, in flat order).
  """
  task = tasks.digits_task()
  params = task.init_params(jax.random.key(seed))
  tx = optax.chain(sparsifier, optax.sgd(0.3))
  rng = np.random.default_rng(seed)
  x, y = zip(*(task.sample_batch(rng, workers * batch) for _ in range(steps)), strict=True)
  # [workers, steps, batch, ...]: every worker its own batches.
  x = np.stack(x).reshape(steps, workers, batch, -1).swapaxes(0, 1)
  y = np.stack(y).reshape(steps, workers, batch).swapaxes(0, 1)

  def worker(x, y):
    def step(carry, batch):
      params, state = carry
      grads = jax.grad(task.loss_fn)(params, *batch)  # this worker's own gradient
      updates, state = tx.update(grads, state, params)
      return (optax.apply_updates(params, updates), state), exdyna_jax.get_stats(state)

    _, stats = jax.lax.scan(step, (params, tx.init(params)), (x, y))
    return stats

  stats = jax.jit(jax.vmap(worker, axis_name=AXIS, axis_size=workers))(x, y)
  trace = {name: np.asarray(value)[0] for name, value in stats._asdict().items()}
  trace["leaf_sizes"] = np.asarray([leaf.size for leaf in jax.tree.leaves(params)])
  return trace


def summarize(traces: dict[str, dict[str, np.ndarray]], target: int, skip: int) -> dict:
  """The numbers the page quotes, from step ``skip`` on."""
  out: dict[str, Any] = {"target_k": target}
  for name, trace in traces.items():
    ratio = trace["transmitted"] / target
    inside = np.nonzero(np.abs(ratio - 1) <= 0.05)[0]
    out[name] = {
        "median_abs_sent_over_k_minus_1": float(np.median(np.abs(ratio[skip:] - 1))),
        "first_step_within_5pct": int(inside[0]) + 1 if inside.size else None,
        "median_sent_over_k": float(np.median(ratio[skip:])),
        "median_imbalance": float(np.median(trace["imbalance"][skip:])),
        "overflow_fraction": float(
            np.sum(trace["overflow"][skip:]) / max(np.sum(trace["selected"][skip:]), 1)
        ),
    }
  return out


def plot_partitions(trace, *, workers: int, path: pathlib.Path) -> None:
  """Partition boundaries over the steps, and worker 0's partition (rotation)."""
  import matplotlib.pyplot as plt

  num_elements = int(trace["leaf_sizes"].sum())
  num_blocks = int(trace["partition_sizes"][0].sum())
  size = -(-num_elements // num_blocks)  # the default layout: the last block short
  starts = trace["partition_starts"] * size  # [steps, n], in elements
  ends = np.minimum(starts + trace["partition_sizes"] * size, num_elements)
  steps = np.arange(1, len(starts) + 1)
  layer_ends = np.cumsum(trace["leaf_sizes"])[:-1]
  colors = plt.get_cmap("tab10")(np.arange(workers) % 10)

  fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [3, 2]})
  ax = axes[0]
  for p in range(workers):
    ax.fill_between(steps, starts[:, p], ends[:, p], step="mid", color=colors[p], alpha=0.55,
                    linewidth=0, label=f"partition {p}")
  for boundary in layer_ends:
    ax.axhline(boundary, color="black", linewidth=0.6, linestyle=":")
  ax.set_xlim(1, steps[-1])
  ax.set_ylim(0, num_elements)
  ax.set_xlabel("step")
  ax.set_ylabel("flat gradient index (element)")
  ax.set_title("(a) partitions over the steps: rebalancing")
  ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False)

  ax = axes[1]
  shown = min(3 * workers, len(steps))
  owned = np.arange(shown) % workers  # at step t, worker 0 owns partition t mod n
  for t in range(shown):
    ax.bar(t + 1, ends[t, owned[t]] - starts[t, owned[t]], bottom=starts[t, owned[t]],
           width=0.8, color=colors[owned[t]], alpha=0.9)
  for boundary in layer_ends:
    ax.axhline(boundary, color="black", linewidth=0.6, linestyle=":")
  ax.set_xlim(0.3, shown + 0.7)
  ax.set_ylim(0, num_elements)
  ax.set_xlabel("step")
  ax.set_title("(b) the range worker 0 selects from: rotation")
  fig.suptitle(f"ExDyna, {workers} workers, {num_blocks} blocks of {size} elements; "
               "dotted: layer boundaries", fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=80)
  plt.close(fig)


def plot_workloads(exdyna, micro, *, skip: int, path: pathlib.Path) -> None:
  """Imbalance per step, and mean per-partition workloads after ``skip``."""
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
  ax = axes[0]
  steps = np.arange(1, len(exdyna["imbalance"]) + 1)
  for trace, label, color in ((micro, "MiCRO (static partitions)", "tab:orange"),
                              (exdyna, "ExDyna (re-cut every step)", "tab:blue")):
    ax.plot(steps, trace["imbalance"], color=color, linewidth=0.9, label=label)
  ax.axhline(1.0, color="black", linewidth=0.6)
  ax.set_xlabel("step")
  ax.set_ylabel("max / mean partition workload")
  ax.set_title("(a) imbalance")
  ax.legend(frameon=False)

  ax = axes[1]
  workers = exdyna["workloads"].shape[1]
  index = np.arange(workers)
  for offset, trace, label, color in ((-0.2, micro, "MiCRO", "tab:orange"),
                                      (0.2, exdyna, "ExDyna", "tab:blue")):
    late = trace["workloads"][skip:].mean(axis=0)
    ax.bar(index + offset, late, width=0.4, color=color, label=label)
    ax.axhline(late.mean(), color=color, linewidth=1.0, linestyle="--")
  ax.set_xticks(index)
  ax.set_xlabel("partition")
  ax.set_ylabel(f"elements passed per step (mean of steps > {skip})")
  ax.set_title("(b) workload per partition; dashed: the mean")
  ax.legend(frameon=False)
  fig.tight_layout()
  fig.savefig(path, dpi=80)
  plt.close(fig)


def plot_threshold(adaptive, reference, *, target: int, path: pathlib.Path) -> None:
  """Indices sent over k, and the threshold, per step for the two rules."""
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
  steps = np.arange(1, len(adaptive["transmitted"]) + 1)
  runs = ((reference, 'controller="reference" (published rules)', "tab:red"),
          (adaptive, "default (adaptive, balanced)", "tab:blue"))
  ax = axes[0]
  for trace, label, color in runs:
    ax.plot(steps, trace["transmitted"] / target, color=color, linewidth=0.9, label=label)
  ax.axhspan(0.95, 1.05, color="gray", alpha=0.25, linewidth=0, label="±5 %")
  ax.set_yscale("log")
  ax.set_xlabel("step")
  ax.set_ylabel("sent / k (transmitted over target)")
  ax.set_title(f"(a) density control, k = {target}")
  ax.legend(frameon=False, fontsize=8)
  ax = axes[1]
  for trace, label, color in runs:
    ax.plot(steps, trace["threshold"], color=color, linewidth=0.9, label=label)
  ax.set_yscale("log")
  ax.set_xlabel("step")
  ax.set_ylabel("threshold")
  ax.set_title("(b) the global threshold")
  fig.tight_layout()
  fig.savefig(path, dpi=80)
  plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--density", type=float, default=0.01)
  parser.add_argument("--workers", type=int, default=8)
  parser.add_argument("--batch", type=int, default=32, help="examples per worker per step")
  parser.add_argument("--num-blocks", type=int, default=None,
                      help="blocks of ExDyna (default: the library's default)")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
  parser.add_argument("--smoke", action="store_true",
                      help="3 steps of ExDyna only, reused for every figure (a quick check)")
  args = parser.parse_args(argv)
  if args.smoke:
    args.steps = 3

  import matplotlib

  matplotlib.use("Agg")
  options = {"steps": args.steps, "workers": args.workers, "batch": args.batch,
             "seed": args.seed}
  d, blocks = args.density, args.num_blocks
  traces = {"exdyna/adaptive": run(exdyna_jax.exdyna(d, num_blocks=blocks), **options)}
  if args.smoke:
    traces["exdyna/reference"] = traces["micro/adaptive"] = traces["exdyna/adaptive"]
  else:
    traces["exdyna/reference"] = run(
        exdyna_jax.exdyna(d, num_blocks=blocks, controller="reference"), **options)
    traces["micro/adaptive"] = run(exdyna_jax.micro(d), **options)
  num_elements = int(traces["exdyna/adaptive"]["leaf_sizes"].sum())
  target = int(d * num_elements)
  skip = min(20, args.steps // 2)
  args.out.mkdir(parents=True, exist_ok=True)
  plot_partitions(traces["exdyna/adaptive"], workers=args.workers, path=args.out / FIGURES[0])
  plot_workloads(traces["exdyna/adaptive"], traces["micro/adaptive"], skip=skip,
                 path=args.out / FIGURES[1])
  plot_threshold(traces["exdyna/adaptive"], traces["exdyna/reference"], target=target,
                 path=args.out / FIGURES[2])
  summary = summarize(traces, target, skip)
  json.dump(summary, sys.stdout, indent=1)
  print()
  return summary


if __name__ == "__main__":
  main()
