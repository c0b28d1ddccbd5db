"""The REPORT section of the language-model benchmark (`language_model.py`).

Every run is compared with a ``ddp`` run of its length at equal steps
(``ddp`` or ``ddp:STEPS``), and with ``ddp``'s final test loss by when it
first reaches it: the step, the bytes each worker had sent, and the time an
alpha-beta network would have taken (the steps' measured seconds here, plus every exchange's
messages and bytes on 1 Gb/s and 100 Mb/s links).
"""

from __future__ import annotations

import math
from typing import Any

from benchmarks.report import plots

MESSAGE_SECONDS = 1e-3  # the emulated cluster's cost of a message is 2-4 ms
RATES = {"1 Gb/s": 1.25e8, "100 Mb/s": 1.25e7}  # bytes per second


def messages_per_exchange(variant: str, workers: int) -> int:
  """An all-reduce's ``2 ceil(log2 n)`` messages for ``dense()``; two all-gathers and an
  all-reduce (``4 ceil(log2 n)``) for a sparsifier."""
  rounds = 1 if variant.startswith(("ddp", "diloco")) else 2
  return rounds * 2 * math.ceil(math.log2(workers))


def at_target(run: dict, target: float) -> dict | None:
  """The first evaluation at or below ``target``, or None."""
  return next((point for point in run["curve"] if point["test_loss"] <= target), None)


def network_seconds(run: dict, step: int, workers: int, rate: float) -> float:
  """Seconds ``run``'s exchanges up to ``step`` take on the alpha-beta network."""
  exchanges = run["exchanges"] * step / run["steps"]
  sent = run["bytes_sent"] * step / run["steps"]
  return exchanges * messages_per_exchange(run["variant"], workers) * MESSAGE_SECONDS + sent / rate


def _rows(data: dict[str, Any], ddp: dict) -> list[list[str]]:
  target, workers = ddp["curve"][-1]["test_loss"], data["config"]["workers"]
  num_elements = ddp["transmitted"] / ddp["exchanges"]  # dense sends every element
  ddp_of_length = {run["steps"]: run["curve"][-1]["test_loss"] for run in data["runs"]
                   if run["variant"].partition(":")[0] == "ddp"}
  rows = []
  for run in data["runs"]:
    final = run["curve"][-1]["test_loss"]
    equal_steps = ddp_of_length.get(run["steps"])
    reached = at_target(run, target)
    cells = ["not reached"] * (2 + len(RATES))
    if reached:
      step = reached["step"]
      cells = [str(step), f"{run['bytes_sent'] * step / run['steps'] / 2**20:.2f}"]
      cells += [f"{reached['seconds'] + network_seconds(run, step, workers, rate):.0f}"
                for rate in RATES.values()]
    rows.append([
        f"`{run['variant']}`", str(run["steps"]), f"{final:.3f}",
        f"{final / equal_steps - 1:+.1%}" if equal_steps else "",
        f"{run['bytes_sent'] / 2**20:.2f}",
        f"{ddp['bytes_sent'] / ddp['steps'] / (run['bytes_sent'] / run['steps']):,.0f}x",
        f"{run['transmitted'] / run['exchanges'] / num_elements:.2%}",
        *cells,
    ])
  return rows


def language_model_section(rep, data: dict[str, Any] | None, table, name: str) -> None:
  """Adds the section of ``name``.json (a corpus's or a model's runs), its table and plots."""
  corpus = data["config"]["corpus"] if data else name
  ddp = next((run for run in data["runs"] if run["variant"] == "ddp"), None) if data else None
  size = f", {ddp['transmitted'] / ddp['exchanges'] / 1e6:.2g}M parameters" if ddp else ""
  if not rep.begin(f"## Language model ({corpus} corpus{size}): quality, bytes and time to "
                   "dense's loss", data, f"{name}.json (python -m benchmarks.run --only {name})"):
    return
  if ddp is None:
    rep.add("_No `ddp` run to compare with._")
    return
  config = data["config"]
  rep.add(
      f"A byte-level decoder transformer (Flax NNX; width {config['width']}, "
      f"{config['layers']} blocks, context {config['context']}) on the `{config['corpus']}` "
      f"corpus, {config['workers']} workers of {config['batch_per_worker']} sequences each, "
      f"AdamW (peak {config['learning_rate']}, warm-up-cosine, weight decay "
      f"{config['weight_decay']}, clipping {config['clip']}); the same batches for every run. "
      "Test loss in nats per byte. Bytes: what each worker sent over its run (the stats' ring "
      "count). `indices / N`: the coordinates an exchange sent (a step's, or with local steps "
      "a sync's), a share of the parameters; `topk@D` asks each worker for `D`, so its union "
      "is larger; `@2xlr` runs at twice the peak; `@DwL` warms the density up to `D`, `L` "
      "steps a level from 12.5 % (the recipe's `dgc_warmup`). Two references, not methods, "
      "send dense's bytes: `sparse_adamw_dense` is "
      "the recipe with nothing left out, `sparse_adamw_oracle@D` keeps the `D` largest of "
      "the workers' mean (error feedback on the mean), the best any selection of `D` could "
      "send. Time to `ddp`'s final "
      f"loss: the steps' seconds measured here (all {config['workers']} workers on this "
      f"machine's cores, so compute is overstated) plus, per exchange, {MESSAGE_SECONDS * 1e3:.0f} "
      "ms a message and the bytes at the link's rate."
  )
  header = ["run", "steps", "final test loss", "vs ddp of its length", "MiB sent",
            "ddp's bytes a step /", "indices / N", "steps to ddp's loss", "MiB to it",
            *(f"seconds to it, {name}" for name in RATES)]
  rep.add(table(header, _rows(data, ddp)))
  by_tokens = {run["variant"]: [(p["step"] * run["tokens_per_step"], p["test_loss"])
                                for p in run["curve"][1:]] for run in data["runs"]}
  slow = RATES["100 Mb/s"]
  by_seconds = {run["variant"]: [(p["seconds"] + network_seconds(
      run, p["step"], config["workers"], slow), p["test_loss"]) for p in run["curve"][1:]]
      for run in data["runs"]}
  target = ddp["curve"][-1]["test_loss"]
  rep.add(rep.save_plot(plots.loss_curves(
      [("test loss against tokens", "tokens", by_tokens),
       ("against seconds, 100 Mb/s (model)", "seconds", by_seconds)], target),
      f"{name}.png"))
