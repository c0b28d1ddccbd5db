"""The REPORT section of `benchmarks/cluster_lm.py`: the language model's time to dense's loss."""

from __future__ import annotations

from typing import Any

from exdyna_jax.demo import cluster

# Issue 47's goals for local steps: times sooner than dense to dense's final test loss.
GOALS = {"1gbit": 3.0, "100mbit": 10.0}


def speedups(invocations: list[dict[str, Any]]) -> dict[tuple[str, str, str], float]:
  """``{(link rate, recipe, method): dense's seconds over the method's}`` to dense's final loss
  in each demo run (methods that did not reach it left out)."""
  found = {}
  for invocation in invocations:
    runs, target = invocation["runs"], cluster.dense_target(invocation["runs"])
    dense = cluster.time_to_target(next(r for r in runs if r["variant"] == "dense"), target)
    for run in runs:
      reached = cluster.time_to_target(run, target)
      if run["variant"] != "dense" and reached and dense:
        found[invocation["link_rate"], invocation["recipe"], run["variant"]] = dense / reached
  return found


def _targets(rep, task: str, invocations: list[dict[str, Any]]) -> None:
  """The goals' rows: the soonest local steps against dense, and against per-step ExDyna."""
  found = speedups(invocations)
  for rate, goal in GOALS.items():
    local = max((x for (r, recipe, _), x in found.items()
                 if r == rate and recipe.startswith("local")), default=None)
    exdyna = next((x for (r, _, method), x in found.items()
                   if r == rate and method == "exdyna"), None)
    if local is None:
      continue
    rep.target(f"cluster, {task}: dense / local steps, time to dense's test loss (n = 4, "
               f"{rate})", f">= {goal:g}", f"{local:.2f}", local >= goal)
    if exdyna is not None:
      rep.target(f"cluster, {task}: per-step exdyna / local steps, time to dense's test loss "
                 f"(n = 4, {rate})", "> 1", f"{local / exdyna:.2f}", local > exdyna)


def _rows(invocation: dict[str, Any]) -> list[list[str]]:
  """One row per method of a demo run: its link rate and recipe, then the demo's columns."""
  rate = invocation["link_rate"]
  return [[rate, invocation["recipe"] if row["method"] != "dense" else "", *row.values()]
          for row in cluster.summary_rows(invocation["runs"])]


def _plot(rep, name: str, task: str, rate: str, invocations: list[dict[str, Any]]) -> str:
  """Test loss against seconds at ``rate``: the first run's dense and every method of every run,
  a local run's method named with its recipe."""
  at_rate = [invocation for invocation in invocations if invocation["link_rate"] == rate]
  runs = [next(run for run in at_rate[0]["runs"] if run["variant"] == "dense")]
  for invocation in at_rate:
    local = invocation["recipe"].startswith("local")
    runs += [{**run, "variant": f"{run['variant']} ({invocation['recipe']})" if local
              else run["variant"]} for run in invocation["runs"] if run["variant"] != "dense"]
  path = cluster.plot_curves(runs, rep.results / f"{name}_{rate}.png",
                             f"{task}, 0.42M transformer, 4 processes at {rate}")
  return f"![{path.name}]({path.name})"


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
      "shaped link, each pinned to its share of this machine's cores). Each row group is "
      "one demo run: dense "
      "trains 200 steps, each other method as many seconds, its learning-rate schedule "
      "over the steps that fit them at the step time it measured after its density warm-up; "
      "'test loss' is at the end of those seconds, "
      "'s to dense's' when it first reached dense's final test loss (the mean of its last "
      "three evaluations in its last tenth of steps), 'sooner' dense's time over it; "
      "'step ms' the median step (of local steps, one without a sync). "
      "Density: indices sent / N at each evaluation; bytes: per worker, the run's mean "
      f"per step. Each run: `{command}` and the recipe's arguments ({commands}).\n\n"
      + table(header, [row for invocation in invocations for row in _rows(invocation)]))
  rates = dict.fromkeys(invocation["link_rate"] for invocation in invocations)
  rep.add("\n\n".join(_plot(rep, name, data["task"], rate, invocations) for rate in rates))
  _targets(rep, data["task"], invocations)
