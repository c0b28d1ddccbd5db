"""Running totals: the run's indices, overflow and bytes, exact, with no sync per step.

``stats.transmitted_total`` and ``overflow_total`` add each completed
step's ``transmitted`` and ``overflow``, ``bytes_total`` every step's
``bytes_sent`` (a skipped step's count included), each in two int32
words; `exdyna_jax.read_totals` turns them into Python ints. The reference
is the sum of the per-step stats, read one step at a time.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import exdyna_jax
from exdyna_jax.core import _stats
from tests import harness, test_nonfinite


@pytest.mark.parametrize("name", exdyna_jax.available_sparsifiers())
def test_totals_are_the_sums_of_the_per_step_stats(name):
  (_, bad_states), _ = test_nonfinite.runs(name)  # 6 steps, steps 1 and 3 skipped
  stats = optax.tree.get(bad_states, "stats")  # [worker, step]
  done = stats.nonfinite[0] == 0
  want = {
      "steps": 4,
      "skipped_steps": 2,
      "transmitted": int(np.sum(stats.transmitted[0][done], dtype=np.int64)),
      "overflow": int(np.sum(stats.overflow[0][done], dtype=np.int64)),
      "bytes_sent": int(np.sum(stats.bytes_sent[0], dtype=np.int64)),
      "target": int(np.sum(stats.target[0][done], dtype=np.int64)),
  }
  final = jax.tree.map(lambda leaf: leaf[:, -1], stats)
  assert exdyna_jax.read_totals(final) == want
  assert want["transmitted"] > 0 and want["bytes_sent"] > 0 and want["target"] > 0


def test_a_total_carries_past_int32_exactly():
  rng = np.random.default_rng(0)
  words, total = jnp.zeros(2, jnp.int32), 0
  for count in [2**31 - 1, 2**31 - 1, 1, 0, *rng.integers(0, 2**31, 50)]:
    words, total = _stats.add_to_total(words, jnp.int32(count)), total + int(count)
    high, low = (int(w) for w in words)
    assert high * 2**31 + low == total and 0 <= low < 2**31


def test_a_step_carries_its_bytes_past_int32():
  """A run whose byte total is 5 short of 2**31 (a dense run of 2**26 float32
  elements on 8 workers gets there in 5 steps) steps on exactly."""
  tx, params = exdyna_jax.dense(), jnp.zeros(1000)
  step = jax.vmap(lambda g, s: tx.update(g, s, params)[1], axis_name="data")
  state = jax.vmap(tx.init, in_axes=None, axis_name="data", axis_size=8)(params)
  near = np.broadcast_to(np.array([0, 2**31 - 5], np.int32), (8, 2))
  state = state._replace(stats=state.stats._replace(bytes_total=near))
  state = step(jnp.ones((8, 1000)), state)
  totals = exdyna_jax.read_totals(state.stats)
  assert totals["bytes_sent"] == 2**31 - 5 + int(state.stats.bytes_sent[0]) > 2**31
  assert totals["transmitted"] == 1000


def test_resizing_keeps_the_totals():
  tx = exdyna_jax.topk(0.05)
  params = jnp.zeros(1000)
  grads = np.random.default_rng(0).normal(size=(4, 3, 1000)).astype(np.float32)
  *_, state = harness.run_vmap(tx, params, grads)
  resized = exdyna_jax.resize_workers(tx, state, params, 2)
  assert exdyna_jax.read_totals(resized.stats) == exdyna_jax.read_totals(state.stats)


@pytest.mark.parametrize("name", exdyna_jax.available_sparsifiers())
def test_the_stats_say_what_each_step_was_asked_to_send(name):
  """``stats.target`` is the step's ``k``: floor(d N) for every method, N for dense, and
  with a warm-up schedule the level the step ran at (N on its dense level)."""
  num_elements, steps = 4096, 3
  grads = jax.random.normal(jax.random.key(0), (8, steps, num_elements))
  tx = exdyna_jax.get_sparsifier(name, **({} if name == "dense" else {"density": 0.01}))
  _, states, _ = harness.run_vmap(tx, jnp.zeros(num_elements), grads)
  want = num_elements if name == "dense" else 40  # floor(0.01 * 4096)
  assert optax.tree.get(states, "stats").target[0].tolist() == [want] * steps
  if name in ("exdyna", "topk"):  # micro and cltk run the same schedule shell
    scheduled = exdyna_jax.get_sparsifier(name, density={0: 1.0, 2: 0.01})
    _, states, _ = harness.run_vmap(scheduled, jnp.zeros(num_elements), grads)
    assert optax.tree.get(states, "stats").target[0].tolist() == [num_elements] * 2 + [40]
