"""The demo: train one model with dense and with sparsified exchanges, compare.

Run it from a shell (8 simulated CPU devices, data bundled with
scikit-learn, nothing downloaded)::

  exdyna-jax demo                                   # dense vs exdyna at 1 %
  exdyna-jax demo --method exdyna topk --density 0.001 --steps 500

or from Python, once JAX has (at least) ``workers`` devices::

  from exdyna_jax import demo
  result = demo.run_demo(["exdyna"], config=demo.TrainConfig(steps=300))

It writes, under a run directory (``runs/`` by default), the per-step metrics
of each method as JSON lines, ``summary.json``, ``table.txt`` and PNG plots.
"""

from exdyna_jax.demo.recipes import TrainConfig
from exdyna_jax.demo.run import DemoResult, default_run_dir, run_demo

__all__ = ["DemoResult", "TrainConfig", "default_run_dir", "run_demo"]
