"""A ``jax.profiler`` trace of device kernels, summed per operation (for `benchmarks.gpu`).

`traced_steps` traces a few steps of a jitted step; `busiest_operations`
reads the trace's device threads; `with_sources` names the Python frame XLA
recorded for each operation in the compiled HLO.
"""

from __future__ import annotations

import collections
import gzip
import json
import pathlib
import re

import jax

PROFILE_STEPS = 5


def traced_steps(directory, step, carry, *args, next_carry=lambda out: out, blocked=False):
  """`busiest_operations` of `PROFILE_STEPS` calls ``step(carry, *args)``, queued
  or ``blocked`` on each (a jitted step, already compiled; ``next_carry`` picks
  the carry from its output), with `with_sources`; the trace and the optimised
  HLO (``step.hlo.txt``) land in ``directory``."""
  directory = pathlib.Path(directory)
  with jax.profiler.trace(str(directory), create_perfetto_trace=True):
    for _ in range(PROFILE_STEPS):
      carry = next_carry(step(carry, *args))
      if blocked:
        carry = jax.block_until_ready(carry)
    jax.block_until_ready(carry)
  hlo = step.lower(carry, *args).compile().as_text()
  (directory / "step.hlo.txt").write_text(hlo)
  return with_sources(busiest_operations(directory, PROFILE_STEPS), hlo)


def busiest_operations(trace_dir, steps, top=12):
  """Per device thread of the ``jax.profiler`` trace in ``trace_dir``: events a
  step, busy microseconds a step, the span a step (first start to last end,
  over ``steps`` queued steps: busy plus the device's idle gaps), the
  device-to-host copies a step (each a wait of the host on the device), the
  ``top`` operations by time and the ``top`` idle gaps by time, each named by
  the operations before and after it (`idle_gaps`). Every operation goes to
  ``operations.json`` in ``trace_dir``."""
  with gzip.open(next(pathlib.Path(trace_dir).rglob("*.trace.json.gz"))) as file:
    trace = json.load(file)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
           if e.get("ph") == "M" and e["name"] in ("process_name", "thread_name")}
  threads = collections.defaultdict(lambda: collections.defaultdict(list))
  spans = collections.defaultdict(list)
  timelines = collections.defaultdict(list)
  for e in events:
    process = names.get((e.get("pid"), None), "")
    if e.get("ph") == "X" and "/device:" in process and "CPU" not in process:
      thread = f"{process} {names.get((e['pid'], e.get('tid')), e.get('tid'))}"
      threads[thread][e["name"]].append(e["dur"])
      spans[thread] += [e["ts"], e["ts"] + e["dur"]]
      timelines[thread].append((e["ts"], e["ts"] + e["dur"], e["name"]))
  summary, everything = {}, {}
  for thread, operations in threads.items():
    ranked = [{"name": name[:160], "count_per_step": len(d) / steps,
               "us_per_step": sum(d) / steps}
              for name, d in sorted(operations.items(), key=lambda item: -sum(item[1]))]
    summary[thread] = {
        "events_per_step": sum(len(d) for d in operations.values()) / steps,
        "busy_us_per_step": sum(sum(d) for d in operations.values()) / steps,
        "span_us_per_step": (max(spans[thread]) - min(spans[thread])) / steps,
        "device_to_host_per_step": len(operations.get("MemcpyD2H", ())) / steps,
        "top": ranked[:top],
        "idle_gaps": idle_gaps(timelines[thread], steps, top),
    }
    everything[thread] = ranked
  (pathlib.Path(trace_dir) / "operations.json").write_text(json.dumps(everything, indent=1))
  return summary


def idle_gaps(timeline, steps, top):
  """The ``top`` idle stretches of a device thread, summed per pair of operations
  around them: ``[{"after", "before", "count_per_step", "us_per_step"}]``."""
  gaps = collections.defaultdict(list)
  busy_until, last = None, None
  for start, end, name in sorted(timeline):
    if busy_until is not None and start > busy_until:
      gaps[(last, name)].append(start - busy_until)
    if busy_until is None or end >= busy_until:
      busy_until, last = end, name
  ranked = sorted(gaps.items(), key=lambda item: -sum(item[1]))[:top]
  return [{"after": after[:80], "before": before[:80], "count_per_step": len(d) / steps,
           "us_per_step": sum(d) / steps} for (after, before), d in ranked]


def with_sources(summary, hlo):
  """Adds to each operation of `busiest_operations` where it came from: the
  innermost Python frame XLA recorded for the instruction of that name
  (``file:function``) and the last part of its ``op_name``."""
  tables = dict(re.findall(r"^(FileNames|FunctionNames|FileLocations|StackFrames)\n((?:\d+ .*\n)+)",
                           hlo, re.MULTILINE))
  rows = {name: dict(re.findall(r"^(\d+) (.*)$", text, re.MULTILINE))
          for name, text in tables.items()}

  def frame(frame_id):  # stack frame -> file location -> file and function names
    location_id = re.search(r"file_location_id=(\d+)", rows["StackFrames"][frame_id])[1]
    fields = dict(re.findall(r"(\w+)=(\d+)", rows["FileLocations"][location_id]))
    file = rows["FileNames"][fields["file_name_id"]].strip('"').rsplit("/", 1)[-1]
    function = rows["FunctionNames"][fields["function_name_id"]].strip('"')
    return f"{file}:{function}"

  sources = {}
  for name, line in re.findall(r"^\s*(?:ROOT )?%([\w.\-]+) = ([^\n]*)$", hlo, re.MULTILINE):
    op_name = re.search(r'op_name="([^"]*)"', line)
    frame_id = re.search(r"stack_frame_id=(\d+)", line)
    where = frame(frame_id[1]) if frame_id and "StackFrames" in rows else ""
    sources[name.replace(".", "_")] = " ".join(
        part for part in (where, op_name[1].rsplit("/", 1)[-1] if op_name else "") if part)
  for thread in summary.values():
    for operation in thread["top"]:
      operation["source"] = sources.get(operation["name"], "")
  return summary
