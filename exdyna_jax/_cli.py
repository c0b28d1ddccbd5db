"""The ``exdyna-jax`` command (also ``python -m exdyna_jax``)."""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import types
from collections.abc import Callable, Sequence

from exdyna_jax.demo.recipes import SHARED_DENSITY, TOPK_UNION, TWO_BIT, demo_methods
from exdyna_jax.demo.tasks import TASKS
from exdyna_jax.launch import _shaped_links
from exdyna_jax.methods._registry import registered_name

DEMO_DESCRIPTION = """\
Train the same model on real bundled data with `dense` (plain all-reduce) and
with sparsified gradient exchanges, on simulated CPU workers, and compare them.

Every method starts from the same weights and sees the same batches. While it
runs you see one progress bar per method; then a table with the final test
accuracy, the density sent (indices transmitted / N, and over the k asked
for), the overflow kept back for later steps, the bytes one worker sends
per step (the library's count; --wide adds the compiled program's) and their
ratio to dense, and the step time. Per-step metrics (JSON lines), the table, a summary
and PNG plots go to the run directory.

No GPU and no network needed: the data is scikit-learn's bundled digits
(85,002-parameter MLP)."""

DEMO_EPILOG = """\
examples:
  exdyna-jax demo                                      dense vs exdyna, density 0.01
  exdyna-jax demo --method exdyna --density 0.001 --steps 500
  exdyna-jax demo --method exdyna micro topk spardl   compare several methods
  exdyna-jax demo --density 0.001 --learning-rate 0.1 --warmup-steps 50
  exdyna-jax demo --density 0.001 --density-warmup 25  25 %, 6.25 %, ... 0.1 %, 25 steps each
  exdyna-jax demo --processes 4 --link-rate 1gbit      4 processes behind 1 Gb/s links (root):
                                                       time to dense's accuracy
  exdyna-jax demo --task lm                            a byte-level transformer, AdamW:
                                                       dense vs exdyna and the 2-bit
                                                       recipe, each as sparse_adamw
  exdyna-jax demo --task lm --sync-every 30 --density 0.05
                                                       local steps: 5 % of the pseudo-gradient
                                                       every 30 steps

outputs (in --run-dir):
  metrics-<method>.jsonl  one line per step: loss, density, sent/k, threshold, overflow,
                          partitions, bytes, step time, test metrics every --eval-every
  table.txt, summary.json the comparison (summary.json also lists the collectives)
  loss.png, density_threshold.png, partitions.png, bytes.png
  with --processes: table.txt, runs.json (test accuracy against seconds), time_to_accuracy.png"""


def _int_at_least(minimum: int) -> Callable[[str], int]:
  """An argparse type: an int of at least ``minimum``."""

  def parse(text: str) -> int:
    value = int(text)
    if value < minimum:
      raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text}")
    return value

  return parse


def _density(text: str) -> float:
  value = float(text)
  if not 0 < value <= 1:
    raise argparse.ArgumentTypeError(f"must be in (0, 1], e.g. 0.001, got {text}")
  return value


def _method(text: str) -> str:
  if (name := text.lower().replace("-", "_")) in SHARED_DENSITY:
    return name
  try:
    return registered_name(text)  # case, "-" and "_" ignored, as get_sparsifier does
  except ValueError:
    raise argparse.ArgumentTypeError(
        f"unknown method {text!r}; choose from {', '.join(demo_methods())}"
    ) from None


def build_parser() -> argparse.ArgumentParser:
  """The argument parser of ``exdyna-jax`` and its sub-commands."""
  parser = argparse.ArgumentParser(
      prog="exdyna-jax",
      description="ExDyna gradient sparsification for JAX: tools.",
  )
  commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
  demo = commands.add_parser(
      "demo", help="train a model with dense and sparsified exchanges and compare them",
      description=DEMO_DESCRIPTION, epilog=DEMO_EPILOG,
      formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  demo.add_argument(
      "--method", nargs="+", type=_method, default=None, metavar="NAME",
      help="method(s) compared with dense (always run): "
      f"{', '.join(m for m in demo_methods() if m != 'dense')}; {TOPK_UNION} is the float32 "
      "AdamW recipe, topk(density / workers, exact=False): each worker its share of "
      f"--density, their union about --density; {TWO_BIT} the 2-bit one, "
      "chunked_topk(6 * density / workers, value_bits=2) after a density warm-up, about the "
      "same bytes "
      f"(default: exdyna; exdyna {TWO_BIT} for the lm tasks)")
  demo.add_argument("--density", type=_density, default=0.01,
                    help="fraction of gradient elements sent per step (default: 0.01)")
  demo.add_argument("--steps", type=_int_at_least(1), default=None,
                    help="training steps per method; with --processes, dense's steps "
                    "(default: 500, 300 for the lm tasks; 200 with --processes)")
  demo.add_argument("--workers", type=_int_at_least(1), default=None,
                    help="simulated data-parallel workers (CPU devices) of a one-process run "
                    "(default: 8; with --processes each process is one worker)")
  demo.add_argument("--batch-per-worker", type=_int_at_least(1), default=None,
                    help="examples per worker per step (default: 32; 8 for the lm tasks)")
  demo.add_argument("--optimizer", choices=("sgd", "adamw"), default=None,
                    help="sgd, or adamw (warm-up-cosine, clipping; after a sparsifier as "
                    "exdyna_jax.sparse_adamw) (default: sgd; adamw for the lm tasks)")
  demo.add_argument("--learning-rate", type=float, default=None,
                    help="learning rate, AdamW's peak (default: 0.3 for sgd; for adamw 3e-3, "
                    f"6e-3 on the lm tasks; per step, {TOPK_UNION}, {TWO_BIT} and chunked_topk "
                    "at twice it, as docs/usage.md advises)")
  demo.add_argument("--sync-every", type=_int_at_least(1), default=1, metavar="H",
                    help="local steps: every method but dense takes H steps alone and "
                    "exchanges the pseudo-gradient at --density (exdyna_jax.local_steps; "
                    "dense stays the per-step baseline) (default: 1, every step)")
  demo.add_argument("--momentum", type=float, default=0.0,
                    help="SGD momentum, applied after aggregation; with error feedback "
                    f"at low density it amplifies stale bursts. {TWO_BIT} runs the momentum-SGD "
                    "recipe instead: each worker's gradient clipped to norm 1, no momentum "
                    "after the sparsifier, the rate over (1 - momentum) (default: 0)")
  demo.add_argument("--density-warmup", type=_int_at_least(0), default=0, metavar="STEPS",
                    help="a DGC-style density warm-up, STEPS per level: 25 %%, then a "
                    f"quarter per level down to --density (default: 0, none; {TWO_BIT} always "
                    "warms up, from 12.5 %% a worker, 10 steps a level unless STEPS)")
  demo.add_argument("--value-dtype", default="float32",
                    choices=("float32", "bfloat16", "float16"),
                    help="dtype the exchanged values are summed in (default: float32)")
  demo.add_argument("--value-bits", type=int, choices=(1, 2, 4, 8), default=None, metavar="B",
                    help="chunked_topk only: its values in B bits (8, 4, 2 or 1) on a scale "
                    "per chunk (default: float values)")
  demo.add_argument("--wire", choices=("all_gather", "all_reduce"), default="all_gather",
                    help="chunked_topk only: all_reduce sends every element (--density 1, "
                    "--value-bits B) to its shard's owner and the owners' means back in B "
                    "bits (default: all_gather)")
  demo.add_argument("--warmup-steps", type=int, default=None,
                    help="learning-rate warm-up steps; helps very low densities "
                    "(default: 0; 30 for the lm tasks)")
  demo.add_argument("--eval-every", type=_int_at_least(1), default=None,
                    help="evaluate on the test set every N steps (default: 25; 10 with "
                    "--processes)")
  demo.add_argument("--seed", type=int, default=0, help="seed of weights and batches")
  add_demo_outputs(demo)
  return parser


def _network_option(text: str) -> tuple[float, float] | str:
  """``SECONDS,BYTES_PER_SECOND`` -> a checked `exdyna_jax.Network`'s pair, or ``"measure"``
  (argparse's type)."""
  from exdyna_jax.exchange import _network

  if text == "measure":
    return text
  try:
    network = _network.Network(*(float(part) for part in text.split(",")))
    return tuple(_network.check_network(network))
  except (TypeError, ValueError) as error:
    raise argparse.ArgumentTypeError(
        "expected two positive numbers SECONDS,BYTES_PER_SECOND (1e-3,1.25e8) or 'measure', "
        f"got {text!r}"
    ) from error


def add_demo_outputs(demo: argparse.ArgumentParser) -> None:
  """The demo's task, cluster and output options."""
  demo.add_argument("--task", choices=sorted(TASKS), default=None,
                    help="digits (85,002-parameter MLP), digits-wide (4.3M; dense's "
                    "exchange dominates its step on a slow link), lm or lm-code (a byte-level "
                    "transformer of 0.42M on Python's help topics or its source; AdamW, 300 "
                    "steps) (default: digits; digits-wide with --processes)")
  cluster = demo.add_argument_group(
      "across processes on shaped links (needs root or an unprivileged user namespace)")
  cluster.add_argument("--processes", type=_int_at_least(2), default=None,
                       help="train as this many JAX processes, one CPU device each, each "
                       "in its own network namespace; dense runs --steps steps, every other "
                       "method as many seconds, and the table says when each reached "
                       "dense's test accuracy")
  cluster.add_argument("--link-rate", default=None,
                       help="each process's link, both ways, in tc's notation: 1gbit, "
                       "100mbit, unshaped, or one rate per process, comma-separated "
                       "(default: 1gbit)")
  demo.add_argument("--network", type=_network_option, default=None,
                    metavar="SECONDS,BYTES_PER_SECOND",
                    help="tell ExDyna what a message and a byte cost between workers "
                    "(exdyna_jax.Network), e.g. 1e-3,1.25e8 for gloo at 1 Gb/s, or 'measure' "
                    "to time it on the workers first (exdyna_jax.Network.measure): it then "
                    "prices its spill, its values' collective and its probe round on that "
                    "(default: not told)")
  demo.add_argument("--run-dir", type=pathlib.Path, default=None,
                    help="output directory (default: runs/<task>-d<density>-<time>)")
  demo.add_argument("--no-progress", action="store_true", help="hide the progress bars")
  demo.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
  demo.add_argument("--wide", action="store_true",
                    help="print every column of the table: the median |sent/k - 1| and the "
                    "bytes counted from the compiled program (default: fits 100 columns)")


def _use_cpu_devices(count: int) -> None:
  """Simulates ``count`` CPU devices; must run before JAX starts its backend."""
  import jax

  try:
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", count)
  except RuntimeError:  # backend already running (in-process use): keep its devices
    pass


# What a task trains with unless told otherwise: SGD on the digits, AdamW on the text.
TASK_DEFAULTS = types.MappingProxyType({
    "digits": {"optimizer": "sgd", "batch_per_worker": 32, "warmup_steps": 0},
    "lm": {"optimizer": "adamw", "batch_per_worker": 8, "warmup_steps": 30},
})
# The learning rate (AdamW's peak) of each task and optimizer: dense's best of those tried
# (AdamW on the digits trains alike from 1e-3 to 3e-2; SGD on the text did worse at 1.0,
# and ExDyna diverged there).
LEARNING_RATES = types.MappingProxyType({
    ("digits", "sgd"): 0.3, ("digits", "adamw"): 3e-3,
    ("lm", "sgd"): 0.3, ("lm", "adamw"): 6e-3,
})


def _demo_config(args: argparse.Namespace, *, task: str, steps: int, eval_every: int):
  from exdyna_jax import demo

  kind = "lm" if task.startswith("lm") else "digits"
  defaults = TASK_DEFAULTS[kind]
  given = {name: getattr(args, name) for name in defaults if getattr(args, name) is not None}
  chosen = {**defaults, **given}
  learning_rate = args.learning_rate
  if learning_rate is None:
    learning_rate = LEARNING_RATES[kind, chosen["optimizer"]]
  return demo.TrainConfig(
      steps=args.steps or steps, density=args.density, momentum=args.momentum,
      density_warmup=args.density_warmup, value_dtype=args.value_dtype, network=args.network,
      eval_every=args.eval_every or eval_every, seed=args.seed, sync_every=args.sync_every,
      value_bits=args.value_bits, wire=args.wire, learning_rate=learning_rate, **chosen,
  )


def demo_methods_of(args: argparse.Namespace) -> list[str]:
  """``--method``, or the task's default: ExDyna, and on the lm tasks the 2-bit AdamW recipe too."""
  if args.method is not None:
    return args.method
  return ["exdyna", TWO_BIT] if (args.task or "").startswith("lm") else ["exdyna"]


def _check_method_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
  """A usage error, before any training, for options the chosen methods refuse."""
  from exdyna_jax.demo import recipes

  methods = demo_methods_of(args)
  if (args.value_bits, args.wire) != (None, "all_gather") and "chunked_topk" not in methods:
    parser.error("--value-bits and --wire are chunked_topk's options: add --method chunked_topk")
  config = _demo_config(args, task=args.task or "digits", steps=1, eval_every=1)
  config = dataclasses.replace(config, network=None)  # checked already; "measure" comes later
  for method in methods:
    try:
      recipes.sparsifier_for(method, config)
    except ValueError as error:
      parser.error(f"--method {method}: {error}")


def run_demo_command(args: argparse.Namespace) -> int:
  """Runs ``exdyna-jax demo`` with parsed arguments; returns the exit status."""
  if args.processes is not None:
    return run_cluster_demo_command(args)
  _use_cpu_devices(args.workers)
  from exdyna_jax import demo

  task = args.task or "digits"
  steps = 300 if task.startswith("lm") else 500
  demo.run_demo(
      demo_methods_of(args), task=task,
      config=_demo_config(args, task=task, steps=steps, eval_every=25), workers=args.workers,
      run_dir=args.run_dir, progress=not args.no_progress, plots=not args.no_plots,
      wide=args.wide,
  )
  return 0


def run_cluster_demo_command(args: argparse.Namespace) -> int:
  """``exdyna-jax demo --processes n``: time to accuracy on shaped links; the exit status."""
  from exdyna_jax.demo import cluster

  try:
    cluster.run_cluster_demo(
        demo_methods_of(args), processes=args.processes, link_rate=args.link_rate or "1gbit",
        task=args.task or cluster.DEFAULT_TASK,
        config=_demo_config(args, task=args.task or cluster.DEFAULT_TASK, steps=200,
                            eval_every=10), run_dir=args.run_dir,
        plots=not args.no_plots,
    )
  except PermissionError as error:
    print(f"exdyna-jax demo: {error}\nWithout --processes the demo runs on simulated "
          "devices of one process and needs no privileges.", file=sys.stderr)
    return 2
  except RuntimeError as error:
    print(f"exdyna-jax demo: {error}", file=sys.stderr)
    return 1
  return 0


def main(argv: Sequence[str] | None = None) -> int:
  """Entry point of ``exdyna-jax``; returns the exit status."""
  parser = build_parser()
  args = parser.parse_args(argv)
  if args.command == "demo" and args.processes is not None and args.workers is not None:
    parser.error("--workers sets the simulated workers of a one-process run; with "
                 "--processes each process is one worker: drop --workers")
  if args.command == "demo" and args.workers is None:
    args.workers = 8
  if args.command == "demo" and args.link_rate is not None:
    if args.processes is None:
      parser.error("--link-rate needs --processes")
    try:
      _shaped_links.link_rates(args.link_rate, args.processes)
    except ValueError as error:
      parser.error(str(error))
  if args.command == "demo":
    _check_method_options(parser, args)
    return run_demo_command(args)
  raise AssertionError(f"unhandled command {args.command!r}")


if __name__ == "__main__":
  sys.exit(main())
