"""``exdyna(network=...)``: the user's network prices the spill and the values' collective.

A ring all-reduce of ``M`` bytes sends ``2 (n-1) / n M`` in ``2 log2 n``
messages at the least, an all-gather of ``M`` bytes a worker ``(n-1) M`` in
``log2 n``. Where messages are dear and the values few, all-gathering the
values and summing them on every worker is the faster exchange: the update
is the same (up to the order of the sum's additions), the bytes counted are
the all-gather's, as compiled. Without a network the values are
all-reduced, as before.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import exdyna_jax
from exdyna_jax import hlo
from exdyna_jax.core import _options
from exdyna_jax.exchange import _network, _spill
from tests import harness

GLOO_1GBIT = exdyna_jax.Network(message_seconds=1e-3, bytes_per_second=1e9 / 8)


def model_seconds(network, num_workers, size_bytes, gather):
  """The alpha-beta model, written out: (messages, bytes a worker sends)."""
  rounds = int(np.ceil(np.log2(num_workers)))
  if gather:
    messages, sent = rounds, (num_workers - 1) * size_bytes
  else:
    messages, sent = 2 * rounds, 2 * (num_workers - 1) * size_bytes // num_workers
  return messages * network.message_seconds + sent / network.bytes_per_second


@pytest.mark.parametrize("network", [_network.NOMINAL, GLOO_1GBIT])
@pytest.mark.parametrize("num_workers", [2, 3, 4, 8, 64])
@pytest.mark.parametrize("size_bytes", [64, 20_000, 50_000, 4_000_000])
def test_values_are_gathered_where_the_model_says_it_is_faster(network, num_workers,
                                                               size_bytes):
  faster = (model_seconds(network, num_workers, size_bytes, gather=True)
            < model_seconds(network, num_workers, size_bytes, gather=False))
  assert _network.gather_pays(network, num_workers, size_bytes) == faster
  if num_workers == 2:  # the same bytes in half the messages
    assert faster


def test_a_slow_network_gathers_the_values_a_fast_one_reduces():
  """4 workers, 20 kB of values (d = 0.001 of the 4.7M MLP): gathered on gloo
  at 1 Gb/s; on 8 workers and 49 kB (d = 0.001 of 11.2M) all-reduced on the
  25 Gb/s, 5 us link."""
  assert _network.gather_pays(GLOO_1GBIT, 4, 20_000)
  assert not _network.gather_pays(_network.NOMINAL, 8, 49_000)


def test_the_spill_is_priced_on_the_users_network():
  """At d = 0.01 of 11.2M on 8 workers the nominal link takes the spill; where
  a message costs 1 ms its extra all-reduce costs more than it saves."""
  target, num_workers = 112_000, 8
  capacity = _options.capacity(
      _options.default_capacity_factor(target, num_workers, "adaptive"), target, num_workers,
      11_200_000)
  assert _spill.choose_spill(None, target, capacity, num_workers) is not None
  assert _spill.choose_spill(None, target, capacity, num_workers, GLOO_1GBIT) is None
  assert _spill.choose_spill(True, target, capacity, num_workers, GLOO_1GBIT) is not None


def one_step_program(tx, num_workers, num_elements, compiled=True):
  """The HLO of one ``update`` on ``num_workers`` devices (or the program we emit)."""
  params = jnp.zeros(num_elements)

  def body(grads):
    state = tx.init(params)
    update, state = tx.update(grads[0], state, params)
    return update[None], jax.tree.map(lambda x: x[None], state)

  fn = jax.shard_map(body, mesh=harness.mesh_of(num_workers), in_specs=jax.P(harness.AXIS),
                     out_specs=jax.P(harness.AXIS), check_vma=False)
  lowered = jax.jit(fn).lower(jnp.ones((num_workers, num_elements)))
  return lowered.compile().as_text() if compiled else lowered.as_text()


@pytest.mark.parametrize("value_dtype", [jnp.float32, jnp.bfloat16])
def test_gathered_values_give_the_all_reduced_run_and_count_their_bytes(value_dtype):
  num_workers, num_elements, density = 4, 40_000, 0.01
  grads = jnp.asarray(np.random.default_rng(3).standard_t(
      3.0, (num_workers, 6, num_elements)), jnp.float32)
  runs = {}
  for network in (None, GLOO_1GBIT):
    tx = exdyna_jax.exdyna(density, network=network, value_dtype=value_dtype)
    updates, states, _ = harness.run_shard_map(tx, jnp.zeros(num_elements), grads)
    runs[network] = (np.asarray(updates), harness.to_numpy(states.stats))
  (reduced, reduced_stats), (gathered, gathered_stats) = runs[None], runs[GLOO_1GBIT]
  assert (gathered_stats.bytes_sent > reduced_stats.bytes_sent).all()
  tx = exdyna_jax.exdyna(density, network=GLOO_1GBIT, value_dtype=value_dtype)
  if value_dtype == jnp.float32:
    np.testing.assert_allclose(gathered, reduced, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(gathered_stats.transmitted, reduced_stats.transmitted)
    # The library's count is what XLA compiled; the values' collective is an
    # all-gather (after the one that carries the probe counts with the index
    # buffers: tests/test_early_selection.py), the one all-reduce left the
    # guard's flags (a skipped step's count of bad elements is not a step's
    # traffic).
    program = one_step_program(tx, num_workers, num_elements)
    found = hlo.collectives(program, num_workers)
    assert [c.kind for c in found] == ["all-reduce"] + ["all-gather"] * 2
    assert hlo.bytes_per_worker(program, num_workers) == gathered_stats.bytes_sent[0, 0]
  else:
    # Summed in bfloat16 in another order: the first step within 3 of its ulps.
    first = np.abs(reduced[:, 0]).max()
    np.testing.assert_allclose(gathered[:, 0], reduced[:, 0], rtol=0, atol=3 * 2**-8 * first)
    # The program we emit gathers bfloat16 (XLA's CPU backend widens it to
    # float32, as it does an all-reduce's; GPU collectives keep it).
    lowered = one_step_program(tx, num_workers, num_elements, compiled=False)
    gathered_types = re.findall(r'"stablehlo.all_gather".*?\) -> tensor<(\w+)>', lowered, re.S)
    assert [x for x in gathered_types if x.endswith("xbf16")], gathered_types


@pytest.mark.parametrize(("network", "error"), [
    ((1e-3, 1e8), TypeError),
    (exdyna_jax.Network(0.0, 1e8), ValueError),
    (exdyna_jax.Network(1e-3, float("inf")), ValueError),
    (exdyna_jax.Network(-1e-3, 1e8), ValueError),
    (exdyna_jax.Network(True, 1e8), TypeError),
    (exdyna_jax.Network(1e-3, "1e8"), TypeError),
])
def test_a_network_is_two_positive_numbers(network, error):
  with pytest.raises(error, match=r"[Nn]etwork"):
    exdyna_jax.exdyna(0.01, network=network)


def test_numpy_and_jax_scalars_make_a_network():
  network = exdyna_jax.Network(np.float32(1e-3), jnp.asarray(1.25e8))
  checked = _network.check_network(network)
  assert all(type(value) is float for value in checked)
  np.testing.assert_allclose(checked, (1e-3, 1.25e8), rtol=1e-6)
  exdyna_jax.exdyna(0.01, network=exdyna_jax.Network(np.float64(1e-3), np.int64(10**8)))


def test_the_demo_passes_its_network_to_exdyna_only():
  """``TrainConfig.network`` (a pair, as JSON carries it to the workers) reaches
  ExDyna's option; Top-k, which has none, is built as before."""
  from exdyna_jax.demo import recipes

  config = recipes.TrainConfig(density=0.01, network=[1e-3, 1.25e8])
  program = one_step_program(recipes.sparsifier_for("exdyna", config), 4, 40_000)
  assert [c.kind for c in hlo.collectives(program, 4)] == ["all-reduce"] + ["all-gather"] * 2
  recipes.sparsifier_for("topk", config)


def test_a_measured_network_is_the_model_through_the_two_timed_gathers(monkeypatch):
  """``Network.measure`` fits ``t(S) = ceil(log2 n) alpha + (n - 1) S / B`` to an
  all-gather of 256 B and one of 4 MiB; every process plans with the slowest
  process's times, so all of them compile the same step."""
  true = exdyna_jax.Network(message_seconds=2e-3, bytes_per_second=1.2e8)
  num_workers = 8
  timed = {size: model_seconds(true, num_workers, size, gather=True)
           for size in (_network.SMALL_MESSAGE_BYTES, _network.LARGE_MESSAGE_BYTES)}
  fitted = _network.fit_network(num_workers, *timed.values())
  np.testing.assert_allclose(fitted, true, rtol=1e-9)
  # Noise: the large gather no slower than the small one still gives a network.
  assert all(value > 0 for value in _network.fit_network(4, 1e-3, 1e-3))
  # Two processes: the other one's gathers took twice as long.
  monkeypatch.setattr(_network, "_all_gather_seconds",
                      lambda mesh, axis, size, repeats: timed[size])
  monkeypatch.setattr(_network.multihost_utils, "process_allgather",
                      lambda seconds: np.stack([seconds, 2 * seconds]))
  measured = exdyna_jax.Network.measure(harness.mesh_of(num_workers))
  np.testing.assert_allclose(
      measured, _network.fit_network(num_workers, *(2 * t for t in timed.values())), rtol=1e-9)


def test_a_network_is_measured_on_the_axis_it_is_asked_for():
  """On forced CPU devices: the gathers run over the named axis of the mesh,
  and the result is a `Network` ExDyna takes."""
  mesh = jax.make_mesh((4, 2), ("node", "local"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  network = exdyna_jax.Network.measure(mesh, "node", repeats=2)
  assert isinstance(network.message_seconds, float) and network.message_seconds > 0
  assert _network.check_network(network) == network
  with pytest.raises(ValueError, match=r"no axis 'data' \(its axes: \('node', 'local'\)\)"):
    exdyna_jax.Network.measure(mesh)
  with pytest.raises(ValueError, match="repeats must be a positive int"):
    exdyna_jax.Network.measure(mesh, "node", repeats=0)
  with pytest.raises(ValueError, match="two or more workers along 'single'"):
    exdyna_jax.Network.measure(
        jax.make_mesh((1,), ("single",), axis_types=(jax.sharding.AxisType.Auto,)), "single")
