"""Section 8: the update and the train step on one GPU (`benchmarks/gpu.py`)."""

from __future__ import annotations

from benchmarks.report._format import Report, short, table

UPDATE_METHODS = ("exdyna", "exdyna_loops", "exdyna_unguarded", "exdyna_unchecked",
                  "exdyna_reference", "micro", "topk_union", "chunked_topk", "topk_ef", "floor")
PROFILE_ITEMS = 5
GAPS = 2


def gpu_section(rep: Report, gpu: dict | None) -> None:
  title = "## 8. One GPU: the update and the train step (`benchmarks/gpu.py`)"
  if not rep.begin(title, gpu, "gpu.json"):
    return
  rep.add(
    f"{gpu['device']} ({gpu['platform']}, jax {gpu.get('jax', '?')}). {gpu['timing']}. "
    "Milliseconds per worker, each step blocked on (the host's dispatch and wait "
    "included); `exdyna queued` is ExDyna with the steps queued (the device's rate), "
    "`exdyna dispatch` the time until the call returns (the host's launches and its wait "
    "for what the program reads back mid-step). "
    "`floor` is the elementwise floor as a program (read the gradient and the residual, "
    "write the residual and the update), `16N B` the same bytes at the copy bandwidth "
    "measured in the row (`y = x + 1` in place, queued): the floor the targets use. "
    "`topk_union` is `topk(d / 8, exact=False)`, the AdamW recipe's sparsifier; "
    "`chunked_topk` is `chunked_topk(d, value_bits=2)`, each worker's own `d` (its "
    "`sent_over_k` counts all 8 workers' picks)."
    + (f" {gpu['sources']}" if "sources" in gpu else "")
  )
  rows = []
  for r in gpu["rows"]:
    methods = [m for m in UPDATE_METHODS if m in r]
    rows.append([
      short(r["elements"]), r["density"],
      *(f"{1e3 * r[m]['seconds']:.3f}" for m in methods),
      f"{1e3 * r['exdyna']['queued_seconds']:.3f}",
      f"{1e3 * r['exdyna']['dispatch_seconds']:.3f}" if "dispatch_seconds" in r["exdyna"] else "",
      f"{1e3 * r['floor_bandwidth_seconds']:.3f}",
      f"{r['exdyna_over_floor']:.2f}", f"{r['exdyna_queued_over_floor']:.2f}",
      f"{r['exdyna_over_floor_program']:.2f}", f"{r['topk_over_exdyna']:.1f}",
    ])
  methods = [m for m in UPDATE_METHODS if m in gpu["rows"][0]]
  rep.add(table(["N", "d", *methods, "exdyna queued", "exdyna dispatch", "16N B",
                 "exdyna / 16N B",
                 "queued / 16N B", "exdyna / floor", "topk_ef / exdyna"], rows))
  at = gpu["at"]
  where = f"N = {short(at['elements'])}, d = {at['density']}"
  rep.target(f"GPU: exdyna / elementwise floor, 16 N bytes ({where})", "<= 2",
             f"{gpu['exdyna_over_floor']:.2f}", gpu["exdyna_over_floor"] <= 2)
  rep.target(f"GPU: topk_ef / exdyna ({where})", ">= 20",
             f"{gpu['topk_over_exdyna']:.1f}", gpu["topk_over_exdyna"] >= 20)
  if "chunk_scales" in gpu:
    rep.add(
      "ExDyna at the target with the partition read in chunks of a multiple of "
      "`_selection.chunk_length` (fewer loop iterations, more elements read past the "
      "partition's ends):\n\n"
      + table(["chunk scale", "chunk", "ms per worker"],
              [[scale, f"{row['chunk']:,}", f"{1e3 * row['seconds']:.3f}"]
               for scale, row in gpu["chunk_scales"].items()])
    )
  if "against_cpu" in gpu:
    against_cpu_paragraph(rep, gpu["against_cpu"])
  if "kernels_against_loops" in gpu:
    check_paragraph(rep, gpu["kernels_against_loops"])
  if "train" in gpu:
    train_table(rep, gpu["train"])
  if "gpt" in gpu:
    gpt_table(rep, gpu["gpt"])
  profiles = gpu.get("profile", {})
  blocked = next(iter(profiles.get("exdyna_blocked", {}).values()), None)
  for thread, summary in profiles.get("exdyna", {}).items():
    rep.add(
      f"Profile of `exdyna` at the target ({thread}): "
      f"{summary['events_per_step']:.0f} device events, "
      f"{summary['device_to_host_per_step']:.0f} device-to-host copies (each a wait "
      f"of the host) and {summary['busy_us_per_step']:,.0f} us busy in a span of "
      f"{summary['span_us_per_step']:,.0f} us per 8-worker step (queued, under the "
      "profiler"
      + (f"; blocked on each step, a span of {blocked['span_us_per_step']:,.0f} us"
         if blocked else "")
      + "); the busiest:\n\n"
      + table(["operation", "from", "per step", "us per step"],
              [[f"`{t['name'][:60]}`", f"`{t['source']}`" if t.get("source") else "",
                f"{t['count_per_step']:g}", f"{t['us_per_step']:,.0f}"]
               for t in summary["top"][:PROFILE_ITEMS]])
    )
  gaps_paragraph(rep, profiles.get("exdyna_blocked") or profiles.get("exdyna", {}))


def train_table(rep: Report, train: dict) -> None:
  names = [n for n in ("compute", "dense", "exdyna", "topk") if n in train]
  rep.add(
    f"The whole train step: an MLP {'-'.join(map(str, train['layers']))} "
    f"({train['parameters']:,} parameters), {train['workers']} workers under `vmap` with "
    f"{train['batch_per_worker']} examples each, `optax.chain(method, optax.sgd)`, d = "
    f"{train['density']}, params and state donated; the collectives are copies on the one "
    "device, so no method pays a network here.\n\n"
    + table(["method", "ms per 8-worker step", "/ compute"],
            [[n, f"{1e3 * train[n]['seconds']:.2f}",
              f"{train[n]['seconds'] / train['compute']['seconds']:.2f}"] for n in names])
  )


def against_cpu_paragraph(rep: Report, check: dict) -> None:
  methods = [k for k, v in check.items() if isinstance(v, dict)]
  same = all(check[m]["transmitted_equal"] for m in methods)
  worst = max(methods, key=lambda m: check[m]["update_relative_difference"])
  rep.add(
    f"Every method's run on the {check['accelerator'].upper()} against the same run on the "
    f"CPU (`--against-cpu`: {', '.join(methods)}; 8 workers, {check['steps']} steps, "
    f"N = {check['elements']:,} in three leaves, d = {check['density']}): the indices sent "
    f"the same at every step: **{same}**; the updates within "
    f"{check[worst]['update_relative_difference']:.1e} relative ({worst}), the states within "
    f"{max(check[m]['state_relative_difference'] for m in methods):.1e}."
  )
  rep.target("GPU: every method's run equals the CPU's (the indices sent)", "equal",
             "equal" if same else "differ", same)


def check_paragraph(rep: Report, check: dict) -> None:
  methods = [m for m in ("exdyna", "exdyna_reference", "micro") if m in check]
  rep.add(
    "The Pallas kernels against the loops on this device (`--check`): the two passes on "
    "one worker's gradient give the same counts, largest magnitude, indices and pass "
    f"count: **{check['passes']}**; over four steps of the 8 workers:\n\n"
    + table(["method", "every state and update the same", "indices sent the same each step",
             "largest threshold difference"],
            [[m, check[m]["bit_for_bit"], check[m]["transmitted_equal"],
              f"{check[m]['threshold_max_relative_difference']:.1e}"] for m in methods])
  )
  rep.target("GPU: the kernels' results equal the loops' (reference rule bit for bit, "
             "adaptive: the indices sent)", "equal",
             "equal" if check["passes"] and check["exdyna_reference"]["bit_for_bit"]
             and check["exdyna"]["transmitted_equal"] else "differ",
             check["passes"] and check["exdyna_reference"]["bit_for_bit"]
             and check["exdyna"]["transmitted_equal"])


def gpt_table(rep: Report, gpt: dict) -> None:
  names = [k for k, v in gpt.items() if isinstance(v, dict) and k != "profile"]
  rep.add(
    f"The train step of a GPT-like transformer: {gpt['layers']} layers, width "
    f"{gpt['width']}, {gpt['heads']} heads, {gpt['vocab']} tokens, context {gpt['context']} "
    f"({gpt['parameters']:,} parameters, causal attention in bfloat16), {gpt['workers']} "
    f"workers under `vmap` with {gpt['sequences_per_worker']} sequences each, "
    "`optax.chain(method, optax.adamw)` (`compute`: AdamW alone, the workers' updates "
    "averaged on the device; `topk_union`: the AdamW recipe, "
    "`sparse_adamw(topk(d / 8, exact=False))`; `chunked_topk`: 2-bit values, what a sync "
    "of local steps adds to its step), params and state donated. `method@d`: the "
    "density; `_loops`: the passes over the partition as XLA loops, as before the kernels; "
    "`_unguarded`: a diagnostic with the guard's conditionals patched out.\n\n"
    + table(["method", "ms per 8-worker step", "queued", "/ compute"],
            [[n, f"{1e3 * gpt[n]['seconds']:.1f}", f"{1e3 * gpt[n]['queued_seconds']:.1f}",
              f"{gpt[n]['seconds'] / gpt['compute']['seconds']:.2f}"] for n in names])
  )
  if "exdyna@0.001" in gpt:
    ratio = gpt["exdyna@0.001"]["seconds"] / gpt["compute"]["seconds"]
    rep.target("GPU: GPT train step, exdyna(0.001) / compute only", "<= 1.2", f"{ratio:.2f}",
               ratio <= 1.2)


def gaps_paragraph(rep: Report, threads: dict) -> None:
  for thread, summary in threads.items():
    if not summary.get("idle_gaps"):
      continue
    rep.add(
      f"Where the device idles in `exdyna`'s traced steps ({thread}; the span "
      f"{summary['span_us_per_step']:,.0f} us against {summary['busy_us_per_step']:,.0f} "
      "us busy per step): the longest idle stretches, by the operations around them.\n\n"
      + table(["after", "before", "per step", "us per step"],
              [[f"`{g['after'][:40]}`", f"`{g['before'][:40]}`", f"{g['count_per_step']:g}",
                f"{g['us_per_step']:,.0f}"] for g in summary["idle_gaps"][:GAPS]])
    )
