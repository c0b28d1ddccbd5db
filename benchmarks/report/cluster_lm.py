"""The REPORT section of `benchmarks/cluster_lm.py`: the language model's time to dense's loss."""

from __future__ import annotations

from typing import Any

from exdyna_jax.demo import cluster


def _rows(invocation: dict[str, Any]) -> list[list[str]]:
  """One row per method of a demo run: its link rate and recipe, then the demo's columns."""
  rate = invocation["link_rate"]
  return [[rate, invocation["recipe"] if row["method"] != "dense" else "", *row.values()]
          for row in cluster.summary_rows(invocation["runs"])]


def cluster_lm_section(rep, data: dict[str, Any] | None, table,
                       name: str = "cluster_lm") -> None:
  """Adds the language model's emulated-cluster section to ``rep``, from ``name``.json."""
  title = "## Emulated cluster: the language model's time to dense's test loss"
  if name != "cluster_lm":
    title += f" ({name}.json)"
  if not rep.begin(title, data, f"{name}.json (python -m benchmarks.cluster_lm, as root)"):
    return
  invocations = data["invocations"]
  header = ["link", "recipe", *cluster.summary_rows(invocations[0]["runs"])[0]]
  command = invocations[0]["command"].split(" --method ")[0]
  command = command.replace(invocations[0]["link_rate"], "RATE")
  recipes = {i["recipe"]: "--method " + i["command"].split(" --method ")[1] for i in invocations}
  commands = "; ".join(f"{recipe}: `{arguments}`" for recipe, arguments in recipes.items())
  rep.add(
      f"`python -m benchmarks.cluster_lm` (task `{data['task']}`, the 0.42M byte-level "
      "transformer, AdamW; 4 processes of one CPU device each, every one behind its own "
      "shaped link, all on this machine's cores). Each row group is one demo run: dense "
      "trains 200 steps, each other method as many seconds, its learning-rate schedule "
      "over the steps it timed to fit them; 'test loss' is at the end of those seconds, "
      "'s to dense's' when it first reached dense's final test loss (the mean of its last "
      "three evaluations in its last tenth of steps), 'sooner' dense's time over it. "
      "Density: indices sent / N at each evaluation; bytes: per worker, the run's mean "
      f"per step. Each run: `{command}` and the recipe's arguments ({commands}).\n\n"
      + table(header, [row for invocation in invocations for row in _rows(invocation)]))
