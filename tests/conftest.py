"""Test setup: 8 forced CPU devices, before the backend starts; cheaper compiles.

The suite's time is mostly XLA compiling small programs, so two settings
serve it (subprocesses started by tests inherit both):

- JAX's persistent compilation cache, in one directory for the whole run
  (both xdist workers and their subprocesses: the examples, the demo, the
  multi-process runs), so a step compiled by one test is not compiled again
  by another; every program is kept, not only those slower than a second to
  compile (a cold run of four modules took 100 s instead of 119 s). Entries
  are keyed by the program and the jax/jaxlib versions.
- LLVM's cheapest code generation for the CPU programs, and XLA:CPU's loop
  fusion emitters instead of its newer fusion emitters (a cold suite took
  284 s instead of 477 s on 2 cores; one ExDyna step compiled in 0.5 s
  instead of 1.4 s): the tests run tiny arrays, where compile time, not run
  time, is what they spend. Fast-math stays off; tests compare against
  NumPy within tolerances, or compare runs compiled with the same flags.
"""

import os
import pathlib
import tempfile

import chex
import jax

CACHE_DIR = os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR",
    str(pathlib.Path(tempfile.gettempdir()) / f"exdyna-jax-tests-{os.getuid()}" / "jax-cache"),
)
jax.config.update("jax_compilation_cache_dir", CACHE_DIR)
# Every program, however quick to compile: the suite compiles many the same.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
FAST_COMPILE = (
    "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    " --xla_cpu_use_fusion_emitters=false"
)
if FAST_COMPILE not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE}".strip()

chex.set_n_cpu_devices(8)
