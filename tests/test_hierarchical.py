"""`exdyna_jax.hierarchical` on 8 forced devices as (2, 4) and (4, 2) meshes.

Every device's gradient is averaged densely over the fast axis ``"local"``;
each method then runs across the slow axis ``"node"`` as if every node were
one worker. The reference is the independent NumPy models of the flat
methods (`tests/models`), fed the mean over ``local`` of each node's
gradients. The gradients are multiples of ``2**-16`` well inside float32's
range, so that mean is exact in any summation order and the models see
bit-identical inputs.

The compiled HLO is also checked: the sparse collectives (all-gather of
indices, the small all-reduces, SparDL's permutes) run only over the slow
axis's replica groups, and the one dense all-reduce only over the fast
axis's groups.
"""

from __future__ import annotations

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import P

import exdyna_jax
from tests.harness import _scan_steps, to_numpy
from tests.models import peers_model
from tests.models.exdyna_model import ExDynaModel
from tests.models.spardl_model import SparDLModel

NODE, LOCAL = "node", "local"
MESHES = {"2x4": (2, 4), "4x2": (4, 2)}
NUM_STEPS = 10
DENSITY = 0.05
NUM_BLOCKS = 16
SHAPES = {"b": (64,), "w": (32, 65)}  # leaves in this (sorted-key) order
NUM_ELEMENTS = sum(math.prod(shape) for shape in SHAPES.values())  # 2144
K = math.floor(DENSITY * NUM_ELEMENTS)
PARAMS = {name: jnp.zeros(shape, jnp.float32) for name, shape in SHAPES.items()}
QUANTUM = 2.0**-16


def _flat_gradients(num_nodes: int, num_local: int, seed: int = 0) -> np.ndarray:
  """``[nodes, local, T, N]`` heavy-tailed, uneven gradients on a 2**-16 grid."""
  rng = np.random.default_rng(seed)
  position = np.arange(NUM_ELEMENTS) / NUM_ELEMENTS
  scale = 0.01 * np.exp(2.0 * position)
  scale[3 * NUM_ELEMENTS // 4 :] = 1e-3
  noise = rng.standard_t(3, size=(num_nodes, num_local, NUM_STEPS, NUM_ELEMENTS))
  device_gain = 1.0 + 0.25 * np.arange(num_nodes * num_local).reshape(num_nodes, num_local)
  step_gain = 0.8 ** np.arange(NUM_STEPS)
  g = noise * scale * device_gain[:, :, None, None] * step_gain[:, None]
  return (np.round(np.clip(g, -8, 8) / QUANTUM) * QUANTUM).astype(np.float32)


def _to_tree(flat: np.ndarray) -> dict[str, np.ndarray]:
  tree, offset = {}, 0
  for name, shape in SHAPES.items():
    size = math.prod(shape)
    tree[name] = flat[..., offset : offset + size].reshape(*flat.shape[:-1], *shape)
    offset += size
  return tree


def _to_flat(tree, lead: int) -> np.ndarray:
  leaves = [np.asarray(leaf) for leaf in jax.tree.leaves(tree)]
  shape = leaves[0].shape[:lead]
  return np.concatenate([leaf.reshape(*shape, -1) for leaf in leaves], axis=-1)


def _capacity(factor: float, num_nodes: int) -> int:
  return math.ceil(factor * K / num_nodes)


def _exdyna_model(g):
  model = ExDynaModel(NUM_ELEMENTS, g.shape[0], DENSITY, NUM_BLOCKS, 1.5)
  records = model.run(g)
  return {
      "updates": np.stack([r.update for r in records]),
      "residuals": np.stack([r.residuals for r in records], axis=1),
      "threshold": np.asarray([r.threshold for r in records]),
      "selected": np.asarray([r.selected for r in records]),
      "transmitted": np.asarray([r.transmitted for r in records]),
      "overflow": np.asarray([r.overflow for r in records]),
      "workloads": np.stack([r.workloads for r in records]),
      "partition_starts": np.stack([r.partition_starts for r in records]),
      "partition_sizes": np.stack([r.partition_sizes for r in records]),
  }


def _trace_model(fn):
  def model(g):
    trace = fn(g)
    return {
        "updates": trace.updates,
        "residuals": trace.residuals,
        "threshold": trace.threshold,
        "selected": trace.selected,
        "transmitted": trace.transmitted,
        "overflow": trace.overflow,
        "workloads": trace.workloads,
    }

  return model


def _spardl_model(g):
  model = SparDLModel(g.shape[0], NUM_ELEMENTS, DENSITY, "log")
  steps = [model.step(g[:, t]) for t in range(g.shape[1])]
  return {
      "updates": np.stack([u for u, _ in steps]),
      "residuals": np.stack([r for _, r in steps], axis=1),
  }


# name -> (sparsifier over "node", NumPy model of [nodes, T, N] node-mean gradients)
CASES = {
    "exdyna": (
        lambda: exdyna_jax.exdyna(
            DENSITY, axis_name=NODE, num_blocks=NUM_BLOCKS, controller="reference"
        ),
        _exdyna_model,
    ),
    "micro": (
        lambda: exdyna_jax.micro(DENSITY, axis_name=NODE, controller="reference"),
        _trace_model(lambda g: peers_model.micro(g, DENSITY, _capacity(1.5, g.shape[0]))),
    ),
    "topk": (
        lambda: exdyna_jax.topk(DENSITY, axis_name=NODE),
        _trace_model(lambda g: peers_model.topk(g, DENSITY)),
    ),
    "hard_threshold": (
        lambda: exdyna_jax.hard_threshold(DENSITY, axis_name=NODE),
        _trace_model(
            lambda g: peers_model.hard_threshold(
                g, peers_model.initial_threshold(K), math.ceil(2.0 * K)
            )
        ),
    ),
    "cltk": (
        lambda: exdyna_jax.cltk(DENSITY, axis_name=NODE),
        _trace_model(lambda g: peers_model.cltk(g, DENSITY)),
    ),
    "spardl": (lambda: exdyna_jax.spardl(DENSITY, axis_name=NODE), _spardl_model),
    "dense": (lambda: exdyna_jax.dense(axis_name=NODE), _trace_model(peers_model.dense)),
}
# Every method on 4 nodes; the methods with distinct collective patterns on 2.
RUNS = [(case, "4x2") for case in CASES] + [
    ("exdyna", "2x4"),
    ("topk", "2x4"),
    ("spardl", "2x4"),
]


def test_every_registered_method_is_covered():
  assert set(CASES) == set(exdyna_jax.available_sparsifiers())


def _mesh(name: str) -> jax.sharding.Mesh:
  shape = MESHES[name]
  return jax.make_mesh(
      shape,
      (NODE, LOCAL),
      axis_types=(jax.sharding.AxisType.Auto,) * 2,
      devices=jax.devices()[: math.prod(shape)],
  )


@functools.cache
def _run(case: str, mesh_name: str):
  """``(grads [nodes, local, T, N], updates, states, compiled HLO text)`` as NumPy."""
  mesh = _mesh(mesh_name)
  tx = exdyna_jax.hierarchical(CASES[case][0](), fast_axis=LOCAL)
  per_device = _scan_steps(tx, PARAMS)

  def body(grads):
    out = per_device(jax.tree.map(lambda g: g[0, 0], grads))
    return jax.tree.map(lambda x: x[None, None], out)

  spec = P(NODE, LOCAL)
  fn = jax.jit(
      jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)
  )
  grads = _flat_gradients(*MESHES[mesh_name])
  tree = _to_tree(grads)
  compiled = fn.lower(tree).compile()
  updates, states, _ = to_numpy(compiled(tree))
  return grads, _to_flat(updates, 3), states, compiled.as_text()


@pytest.mark.parametrize(("case", "mesh_name"), RUNS)
def test_matches_model_of_node_means(case, mesh_name):
  grads, updates, states, _ = _run(case, mesh_name)
  num_nodes, num_local = MESHES[mesh_name]
  node_mean = grads.mean(axis=1, dtype=np.float32)  # exact: a 2**-16 grid
  np.testing.assert_array_equal(node_mean * num_local, grads.sum(axis=1, dtype=np.float64))
  expected = CASES[case][1](node_mean)

  # One update on all 8 devices, equal to the model's.
  for node in range(num_nodes):
    for local in range(num_local):
      np.testing.assert_array_equal(updates[node, local], updates[0, 0])
  np.testing.assert_array_equal(updates[0, 0] != 0, expected["updates"] != 0)
  np.testing.assert_allclose(updates[0, 0], expected["updates"], rtol=1e-5, atol=1e-9)

  # Every device of a node holds that node's residual, exactly the model's.
  residuals = getattr(states, "residual", None)
  if residuals is None:  # dense keeps none
    residuals = np.zeros((num_nodes, num_local, NUM_STEPS, NUM_ELEMENTS), np.float32)
  else:
    residuals = residuals.reshape(num_nodes, num_local, NUM_STEPS, -1)[..., :NUM_ELEMENTS]
  for local in range(num_local):
    np.testing.assert_array_equal(residuals[:, local], expected["residuals"])

  # Conservation per node: sum_node m(new) + nodes * update == sum_node (mean + m(old)).
  node_residuals = residuals[:, 0]
  previous = np.concatenate([np.zeros_like(node_residuals[:, :1]), node_residuals[:, :-1]], 1)
  accumulated = np.sum(node_mean + previous, axis=0, dtype=np.float64)
  kept = np.sum(node_residuals, axis=0, dtype=np.float64) + num_nodes * updates[0, 0]
  np.testing.assert_allclose(kept, accumulated, rtol=1e-5, atol=1e-6)

  # Statistics: n = number of nodes, the same on every device.
  stats = states.stats
  assert stats.workloads.shape[-1] == num_nodes
  for name in (
      "threshold",
      "selected",
      "transmitted",
      "overflow",
      "workloads",
      "partition_starts",
      "partition_sizes",
  ):
    if name in expected:
      got = np.asarray(getattr(stats, name))
      for node in range(num_nodes):
        for local in range(num_local):
          np.testing.assert_array_equal(got[node, local], expected[name], err_msg=name)
  np.testing.assert_array_equal(stats.step[0, 0], np.arange(1, NUM_STEPS + 1))


def test_the_data_exercise_exdyna():
  """Partitions move and nodes disagree, so the comparisons are not vacuous."""
  _, _, states, _ = _run("exdyna", "4x2")
  sizes = states.stats.partition_sizes[0, 0]
  assert len({tuple(row) for row in sizes}) > 2
  _, _, states, _ = _run("topk", "4x2")
  assert np.all(states.stats.transmitted[0, 0] > K)  # the nodes' top-k differ


# --- The compiled HLO: which collective runs over which replica groups. ---

COLLECTIVE = re.compile(
    r"=\s*(?P<shape>\(.*?\)|\S+)\s+"
    r"(?P<op>all-reduce|all-gather|collective-permute|reduce-scatter|all-to-all)"
    r"(?:-start)?\("
)
EXPLICIT_GROUPS = re.compile(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}")
IOTA_GROUPS = re.compile(
    r"replica_groups=\[(?P<groups>[\d,]+)\]<=\[(?P<dims>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?"
)
PAIRS = re.compile(r"source_target_pairs=\{(\{\d+,\d+\}(?:,\{\d+,\d+\})*)\}")


def _ints(text: str) -> list[int]:
  return [int(v) for v in text.split(",") if v]


def replica_groups(line: str) -> frozenset[frozenset[int]] | None:
  """The replica groups of one HLO instruction (explicit or iota form)."""
  if match := EXPLICIT_GROUPS.search(line):
    return frozenset(frozenset(_ints(g)) for g in re.findall(r"\{([\d,]*)\}", match.group(1)))
  if match := IOTA_GROUPS.search(line):
    dims = _ints(match.group("dims"))
    ids = np.arange(math.prod(dims)).reshape(dims)
    if match.group("perm"):
      ids = ids.transpose(_ints(match.group("perm")))
    return frozenset(frozenset(row) for row in ids.reshape(_ints(match.group("groups"))).tolist())
  return None


def collectives(hlo: str) -> list[tuple[str, int, frozenset[frozenset[int]]]]:
  """``(op, elements moved, replica groups)`` of every collective in ``hlo``.

  A collective-permute's groups are its source-target pairs.
  """
  found = []
  for line in hlo.splitlines():
    match = COLLECTIVE.search(line)
    if match is None or "-done" in match.group("op"):
      continue
    shape = match.group("shape")
    elements = sum(math.prod(_ints(dims) or [1]) for dims in re.findall(r"\[([\d,]*)\]", shape))
    if match.group("op") == "collective-permute":
      pairs = re.findall(r"\{(\d+),(\d+)\}", PAIRS.search(line).group(1))
      groups = frozenset(frozenset((int(a), int(b))) for a, b in pairs)
    else:
      groups = replica_groups(line)
    assert groups is not None, line
    found.append((match.group("op"), elements, groups))
  return found


def test_replica_group_parser():
  assert replica_groups("x, replica_groups={{0,4},{1,5}}, y") == {
      frozenset({0, 4}),
      frozenset({1, 5}),
  }
  assert replica_groups("replica_groups=[2,4]<=[8], use") == {
      frozenset(range(4)),
      frozenset(range(4, 8)),
  }
  assert replica_groups("replica_groups=[4,2]<=[2,4]T(1,0), use") == {
      frozenset({i, i + 4}) for i in range(4)
  }
  (op,) = collectives(
      "%a = (s32[9]{0}, s32[]) all-reduce-start(%x, %y), channel_id=1, "
      "replica_groups={{0,4},{1,5},{2,6},{3,7}}, use_global_device_ids=true"
  )
  assert op[:2] == ("all-reduce", 10)


@pytest.mark.parametrize(("case", "mesh_name"), RUNS)
def test_hlo_sparse_only_across_nodes_dense_only_within(case, mesh_name):
  *_, hlo = _run(case, mesh_name)
  ids = np.asarray([d.id for d in _mesh(mesh_name).devices.flat]).reshape(MESHES[mesh_name])
  fast = frozenset(frozenset(row) for row in ids.tolist())  # one group per node
  slow = frozenset(frozenset(col) for col in ids.T.tolist())  # one per local rank

  def within(groups, axis_groups):
    return all(any(g <= a for a in axis_groups) for g in groups)

  ops = collectives(hlo)
  fast_ops = [op for op in ops if within(op[2], fast) and not within(op[2], slow)]
  slow_ops = [op for op in ops if within(op[2], slow) and not within(op[2], fast)]
  assert len(fast_ops) + len(slow_ops) == len(ops), ops  # nothing spans both axes

  # Within a node: exactly the dense mean of the N-element gradient.
  assert [op[0] for op in fast_ops] == ["all-reduce"], fast_ops
  assert fast_ops[0][1] == NUM_ELEMENTS

  # Across nodes: the method's own exchange; sparse (small) unless it is dense.
  assert slow_ops
  small = [op for op in slow_ops if op[1] < NUM_ELEMENTS // 2]
  if case == "dense":  # the baseline: dense across nodes too, plus scalars
    assert [op[:2] for op in slow_ops if op not in small] == [("all-reduce", NUM_ELEMENTS)]
  else:
    assert small == slow_ops, slow_ops
  kinds = {op[0] for op in slow_ops}
  if case in ("exdyna", "micro", "topk", "hard_threshold"):
    assert {"all-gather", "all-reduce"} <= kinds, kinds
  if case == "spardl":
    assert "collective-permute" in kinds, kinds


def test_fast_axis_must_be_bound():
  tx = exdyna_jax.hierarchical(exdyna_jax.topk(DENSITY, axis_name=NODE))
  with pytest.raises(ValueError, match="fast axis 'local' is not bound"):
    jax.vmap(tx.init, axis_name=NODE, axis_size=2)(jnp.zeros((2, 64)))
  with pytest.raises(ValueError, match="fast_axis must be"):
    exdyna_jax.hierarchical(exdyna_jax.dense(), fast_axis="")


def test_nested_vmap_and_bfloat16():
  """Simulated 2 x 2 devices with nested vmap; bf16 leaves keep their dtype."""
  tx = exdyna_jax.hierarchical(exdyna_jax.topk(0.25, axis_name=NODE))
  params = {"w": jnp.zeros((16,), jnp.bfloat16)}
  grads = {"w": jnp.arange(64, dtype=jnp.bfloat16).reshape(2, 2, 16) / 64}

  def device(g):
    updates, state = tx.update(g, tx.init(params), params)
    return updates, state

  inner = jax.vmap(device, axis_name=LOCAL)
  updates, state = jax.jit(jax.vmap(inner, axis_name=NODE))(grads)
  assert updates["w"].dtype == jnp.bfloat16
  node_mean = np.asarray(grads["w"], np.float32).mean(axis=1)  # [2 nodes, 16]
  expected = peers_model.topk(node_mean[:, None, :], 0.25).updates[0]
  np.testing.assert_allclose(np.asarray(updates["w"][0, 0], np.float32), expected, rtol=1e-2)
  assert int(exdyna_jax.get_stats(state).step[0, 0]) == 1
