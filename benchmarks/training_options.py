"""Density warm-up and a bfloat16 wire: accuracy, density and bytes at equal steps.

Trains the demo's digits MLP and ``examples/char_transformer.py`` on 8
simulated workers with the demo's trainer, the same batches for every
variant: dense, ExDyna, ExDyna with a DGC-style density warm-up
(`exdyna_jax.dgc_warmup`: 25 %, then a quarter per level down to the
density) and ExDyna summing its values in bfloat16 (``value_dtype``). Each
row reports the held-out metric, the mean density sent and the mean bytes
one worker sent per step (the library's count, which follows the level).
It also measures the bytes per step at the cost benchmark's configuration
(N = 11.2M, n = 8, d = 0.001) in float32 and bfloat16 from one step.

Run: python -m benchmarks.training_options [--quick] [--out results/training_options.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import pathlib
import statistics
import sys

from benchmarks import _common

HERE = pathlib.Path(__file__).resolve().parent

VARIANTS = {
    "dense": ("dense", {}),
    "exdyna": ("exdyna", {}),
    "exdyna + warm-up": ("exdyna", {"density_warmup": 25}),
    "exdyna, bf16 values": ("exdyna", {"value_dtype": "bfloat16"}),
}


def char_task():
  path = HERE.parent / "examples" / "char_transformer.py"
  spec = importlib.util.spec_from_file_location("char_transformer", path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # its dataclasses look their module up
  spec.loader.exec_module(module)
  return module.char_lm_task()


def workloads(quick: bool):
  """``(name, task, base TrainConfig, metric)`` of each model."""
  from exdyna_jax.demo import TrainConfig, tasks

  steps = 60 if quick else 300
  digits = TrainConfig(steps=steps, density=0.01, eval_every=steps)  # the demo's
  char = TrainConfig(
      steps=steps, density=0.01, batch_per_worker=8, learning_rate=0.3, warmup_steps=20,
      eval_every=steps,
  )
  yield "digits MLP", tasks.digits_task(), digits, "test_accuracy"
  yield "char transformer", char_task(), char, "test_perplexity"
  if not quick:
    yield "digits MLP", tasks.digits_task(), dataclasses.replace(digits, density=0.001), (
        "test_accuracy"
    )
    yield "char transformer", char_task(), dataclasses.replace(char, density=0.001), (
        "test_perplexity"
    )


def wire_bytes(num_elements: int) -> dict[str, int]:
  """Bytes one worker sends in one ExDyna step, float32 and bfloat16 values."""
  import jax
  import jax.numpy as jnp

  import exdyna_jax

  out = {}
  grads = jax.random.normal(jax.random.key(0), (8, num_elements))
  for dtype in ("float32", "bfloat16"):
    tx = exdyna_jax.exdyna(0.001, value_dtype=dtype)
    params = jnp.zeros(num_elements)

    def one_step(g, tx=tx, params=params):
      return exdyna_jax.get_stats(tx.update(g, tx.init(params), params)[1]).bytes_sent

    out[dtype] = int(jax.jit(jax.vmap(one_step, axis_name=_common.AXIS))(grads)[0])
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--out", default=str(_common.RESULTS / "training_options.json"))
  args = parser.parse_args()
  _common.force_devices(8)
  from exdyna_jax.demo import trainer

  mesh = trainer.make_mesh(8)
  rows = []
  for model, task, config, metric in workloads(args.quick):
    for variant, (method, options) in VARIANTS.items():
      run = trainer.train_method(method, task, dataclasses.replace(config, **options), mesh)
      rows.append({
          "model": model,
          "variant": variant,
          "density": config.density,
          "steps": config.steps,
          "metric": metric,
          "value": run.final_metrics[metric],
          "mean_density_sent": statistics.fmean(r["density"] for r in run.records),
          "mean_bytes_sent": statistics.fmean(r["bytes_sent"] for r in run.records),
          "final_bytes_sent": run.records[-1]["bytes_sent"],
      })
      _common.log(model, config.density, variant, f"{metric}={rows[-1]['value']:.4f}",
                  f"bytes={rows[-1]['mean_bytes_sent']:.0f}")
  num_elements = 1_000_000 if args.quick else 11_200_000
  payload = {
      "machine": _common.machine_info(),
      "rows": rows,
      "wire": {"num_elements": num_elements, "bytes": wire_bytes(num_elements)},
  }
  _common.write_json(args.out, payload)
  _common.log(f"wrote {args.out}")


if __name__ == "__main__":
  main()
