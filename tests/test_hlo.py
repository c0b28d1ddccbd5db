"""The HLO reader: what a compiled program's collectives send, priced per worker."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from exdyna_jax import hlo
from exdyna_jax.methods.exdyna import _early_selection
from exdyna_jax.shell import _guard


def test_hlo_parser_prices_ring_collectives():
  text = """
%small (p: s32[9]) -> s32[9] {
  %p = s32[9]{0} parameter(0)
  ROOT %s = s32[9]{0} all-reduce(%p), channel_id=5, replica_groups={{0,1,2,3,4,5,6,7}}
}

%large (q: s32[9]) -> s32[9] {
  %q = s32[9]{0} parameter(0)
  %t = s32[18]{0} all-reduce(%q), channel_id=6, replica_groups={{0,1,2,3,4,5,6,7}}
  ROOT %u = s32[9]{0} slice(%t), slice={[0:9]}
}

ENTRY %main (x: f32[128]) -> f32[128] {
  %a = (f32[128]{0}, f32[]) all-reduce(%x, %y), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}
  %b = s32[8,17]{1,0} all-gather(%z), channel_id=2, replica_groups=[1,8]<=[8], dimensions={0}
  %c = s32[4,20]{1,0} collective-permute(%w), channel_id=3, source_target_pairs={{0,4}}
  %d = f32[16]{0} reduce-scatter(%v), replica_groups={{0,1},{2,3}}, dimensions={0}
  %k = s32[9]{0} conditional(%i, %j, %j), branch_computations={%small, %large}
  %m = s32[] all-reduce(%n), replica_groups=[1,8]<=[8], metadata={op_name="a/skipped_step/b"}
  ROOT %e = f32[128]{0} add(%a, %a)
}
"""
  found = hlo.collectives(text, num_devices=8)
  assert [c.kind for c in found] == [
      "all-reduce", "all-gather", "collective-permute", "reduce-scatter", "all-reduce"]
  # A permute with one pair out of 8 devices: 320 B from one worker, 40 B on average.
  # A conditional counts once, for its most expensive branch; the guard's count
  # of a skipped step's bad elements (its name scope) is not a step's traffic.
  assert [c.bytes_sent for c in found] == [
      2 * 7 * 516 // 8, 7 * 544 // 8, 320 // 8, 64, 2 * 7 * 72 // 8]
  assert hlo.bytes_per_worker(text, 8) == sum(c.bytes_sent for c in found)
  assert [c.group_size for c in found] == [8, 8, 8, 2, 8]
  assert found[-1].context == "conditional"
  assert found[0].shapes == (("f32", (128,)), ("f32", ()))


def test_the_rare_steps_name_scopes_are_the_librarys():
  """The reader skips what the library runs only on a rare step, by name scope; it imports
  nothing of the library, so the names are written out there."""
  assert hlo.SKIPPED_STEP_SCOPE == _guard.SKIPPED_STEP_SCOPE
  assert hlo.SELECTED_AGAIN_SCOPE == _early_selection.SELECTED_AGAIN_SCOPE


@pytest.mark.parametrize(("kind", "expected"), [
    ("all-reduce", (2 * 3 / 4 * 400, 6, 4)),
    ("all-gather", (3 / 4 * 400, 3, 2)),
    ("all-to-all", (3 / 4 * 400, 3, 2)),
    ("reduce-scatter", (3 * 400, 3, 2)),
])
def test_ring_cost_of_each_kind(kind, expected):
  assert tuple(hlo.ring_cost(kind, 400, 4)) == pytest.approx(expected)
  assert tuple(hlo.ring_cost(kind, 400, 1)) == (0.0, 0.0, 0.0)


def test_a_program_without_collectives_sends_nothing():
  text = jax.jit(lambda x: x * 2).lower(jnp.ones(4)).compile().as_text()
  assert hlo.collectives(text, 1) == [] and hlo.bytes_per_worker(text, 1) == 0
