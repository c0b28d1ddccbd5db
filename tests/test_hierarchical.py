"""`exdyna_jax.hierarchical` on 8 forced devices as (2, 4) and (4, 2) meshes.

Both ways of reducing over the fast axis ``"local"`` are checked against the
independent NumPy models of the flat methods (`tests/models`), fed the mean
over ``local`` of each node's gradients:

* ``fast_reduce="psum"``: every device holds the whole node mean, and each
  method runs across the slow axis ``"node"`` as if every node were one
  worker: one model run over ``[nodes, T, N]``, the same on every device.
* ``fast_reduce="scatter"``: the node mean is flattened, zero-padded to
  ``L * S`` (``S = ceil(N / L)``; ``N = 2143`` is a multiple of neither 2 nor
  4, so the padding is exercised) and local device ``l`` runs the method on
  slice ``l`` only: one model run per slice over ``[nodes, T, S]``, the
  update the concatenation of the slices' updates.

The gradients are multiples of ``2**-16`` well inside float32's range, so
the node mean is exact in any summation order and the models see
bit-identical inputs.

The compiled HLO is also checked: the sparse collectives (all-gather of
indices, the small all-reduces, SparDL's permutes) run only over the slow
axis's replica groups, and the dense ones (the all-reduce, or the
reduce-scatter and all-gather) only over the fast axis's groups; and the
inter-node bytes of the compiled program drop by ``L`` in scatter mode.
"""

from __future__ import annotations

import functools
import math
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax import P

import exdyna_jax
from exdyna_jax import hlo
from tests.harness import AXIS, _scan_steps, run_shard_map, to_numpy, unflatten_like
from tests.models import peers_model
from tests.models.exdyna_model import ExDynaModel
from tests.models.spardl_model import SparDLModel

NODE, LOCAL = "node", "local"
MESHES = {"2x4": (2, 4), "4x2": (4, 2)}
NUM_STEPS = 10
DENSITY = 0.05
NUM_BLOCKS = 16
SHAPES = {"b": (63,), "w": (32, 65)}  # leaves in this (sorted-key) order
NUM_ELEMENTS = sum(math.prod(shape) for shape in SHAPES.values())  # 2143
MODES = ("psum", "scatter")
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


def _to_flat(tree, lead: int) -> np.ndarray:
  leaves = [np.asarray(leaf) for leaf in jax.tree.leaves(tree)]
  shape = leaves[0].shape[:lead]
  return np.concatenate([leaf.reshape(*shape, -1) for leaf in leaves], axis=-1)


def _k(num_elements: int) -> int:
  return math.floor(DENSITY * num_elements)


def _capacity(factor: float, num_nodes: int, num_elements: int) -> int:
  return math.ceil(factor * _k(num_elements) / num_nodes)


# Every model takes node-level gradients [nodes, T, M] (M = N, or a slice's S).


def _exdyna_model(g):
  model = ExDynaModel(g.shape[-1], g.shape[0], DENSITY, NUM_BLOCKS, 1.5)
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
  model = SparDLModel(g.shape[0], g.shape[-1], DENSITY, "log")
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
        _trace_model(
            lambda g: peers_model.micro(g, DENSITY, _capacity(1.5, g.shape[0], g.shape[-1]))
        ),
    ),
    "topk": (
        lambda: exdyna_jax.topk(DENSITY, axis_name=NODE),
        _trace_model(lambda g: peers_model.topk(g, DENSITY)),
    ),
    "hard_threshold": (
        lambda: exdyna_jax.hard_threshold(DENSITY, axis_name=NODE),
        _trace_model(
            lambda g: peers_model.hard_threshold(
                g, peers_model.initial_threshold(_k(g.shape[-1])), math.ceil(2.0 * _k(g.shape[-1]))
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
RUNS = [
    (case, mesh_name, mode)
    for mode in MODES
    for case, mesh_name in [(case, "4x2") for case in CASES]
    + [("exdyna", "2x4"), ("topk", "2x4"), ("spardl", "2x4")]
]


@pytest.mark.parametrize(
    "name", [name for name in exdyna_jax.available_sparsifiers() if name not in CASES])
def test_every_registered_method_runs_across_nodes_as_across_workers(name):
  """With ``fast_reduce="psum"`` a node is one worker: the method itself on node means.

  Every registered method that `CASES` leaves out, with its defaults, so a new
  one is covered as soon as it is registered (`test_matches_model_of_node_means`
  checks the methods of `CASES` against their NumPy models).
  """
  grads, updates, states, _ = _run(name, "4x2", "psum", registered=True)
  node_mean = grads.mean(axis=1, dtype=np.float32)  # exact: a 2**-16 grid
  tree = unflatten_like(node_mean, {key: np.zeros(shape) for key, shape in SHAPES.items()})
  flat_updates, flat_states, _ = to_numpy(run_shard_map(_registered(name, AXIS), PARAMS, tree))
  flat_updates = _to_flat(flat_updates, 2)
  for local in range(MESHES["4x2"][1]):
    np.testing.assert_array_equal(updates[:, local] != 0, flat_updates != 0)
    np.testing.assert_allclose(updates[:, local], flat_updates, rtol=1e-6, atol=1e-9)
    on_device = jax.tree.map(lambda leaf, local=local: leaf[:, local], states)
    chex.assert_trees_all_close(on_device, flat_states, rtol=1e-6, atol=1e-9)
  assert np.abs(flat_updates).max() > 0


def _mesh(name: str) -> jax.sharding.Mesh:
  shape = MESHES[name]
  return jax.make_mesh(
      shape,
      (NODE, LOCAL),
      axis_types=(jax.sharding.AxisType.Auto,) * 2,
      devices=jax.devices()[: math.prod(shape)],
  )


def _registered(name: str, axis_name: str) -> optax.GradientTransformation:
  """The registered method ``name`` with its default options at ``DENSITY``."""
  options = {} if name == "dense" else {"density": DENSITY}
  return exdyna_jax.get_sparsifier(name, axis_name=axis_name, **options)


@functools.cache
def _run(case: str, mesh_name: str, mode: str, registered: bool = False):
  """``(grads [nodes, local, T, N], updates, states, compiled HLO text)`` as NumPy.

  The sparsifier is ``CASES[case]``'s, or with ``registered`` the registry's
  method ``case`` with its defaults.
  """
  mesh = _mesh(mesh_name)
  sparsifier = _registered(case, NODE) if registered else CASES[case][0]()
  tx = exdyna_jax.hierarchical(sparsifier, fast_axis=LOCAL, fast_reduce=mode)
  per_device = _scan_steps(tx, PARAMS)

  def body(grads):
    out = per_device(jax.tree.map(lambda g: g[0, 0], grads))
    return jax.tree.map(lambda x: x[None, None], out)

  spec = P(NODE, LOCAL)
  fn = jax.jit(
      jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)
  )
  grads = _flat_gradients(*MESHES[mesh_name])
  tree = unflatten_like(grads, {name: np.zeros(shape) for name, shape in SHAPES.items()})
  compiled = fn.lower(tree).compile()
  updates, states, _ = to_numpy(compiled(tree))
  return grads, _to_flat(updates, 3), states, compiled.as_text()


def _slice_models(case: str, node_mean: np.ndarray, num_local: int, mode: str):
  """``(model of each local rank, slice width)`` for node-mean gradients ``[nodes, T, N]``.

  psum: one model over the whole vector, the same for every local rank.
  scatter: the vector zero-padded to ``L * S``, local rank ``l``'s model over
  elements ``[l*S, (l+1)*S)``.
  """
  model = CASES[case][1]
  if mode == "psum":
    return [model(node_mean)] * num_local, NUM_ELEMENTS
  width = math.ceil(NUM_ELEMENTS / num_local)
  padded = np.zeros((*node_mean.shape[:-1], num_local * width), np.float32)
  padded[..., :NUM_ELEMENTS] = node_mean
  slices = [padded[..., l * width : (l + 1) * width] for l in range(num_local)]  # noqa: E741
  return [model(s) for s in slices], width


@pytest.mark.parametrize(("case", "mesh_name", "mode"), RUNS)
def test_matches_model_of_node_means(case, mesh_name, mode):
  grads, updates, states, _ = _run(case, mesh_name, mode)
  num_nodes, num_local = MESHES[mesh_name]
  node_mean = grads.mean(axis=1, dtype=np.float32)  # exact: a 2**-16 grid
  np.testing.assert_array_equal(node_mean * num_local, grads.sum(axis=1, dtype=np.float64))
  models, width = _slice_models(case, node_mean, num_local, mode)
  if mode == "psum":
    expected_update = models[0]["updates"]
  else:
    expected_update = np.concatenate([m["updates"] for m in models], -1)[:, :NUM_ELEMENTS]

  # One update on all 8 devices, equal to the model's.
  for node in range(num_nodes):
    for local in range(num_local):
      np.testing.assert_array_equal(updates[node, local], updates[0, 0])
  np.testing.assert_array_equal(updates[0, 0] != 0, expected_update != 0)
  np.testing.assert_allclose(updates[0, 0], expected_update, rtol=1e-5, atol=1e-9)

  # Device (node, l) holds the residual of node `node` in local rank l's model:
  # the node's whole residual (psum), or that of its slice (scatter).
  residuals = getattr(states, "residual", None)
  if residuals is None:  # dense keeps none
    residuals = np.zeros((num_nodes, num_local, NUM_STEPS, width), np.float32)
  else:
    residuals = residuals.reshape(num_nodes, num_local, NUM_STEPS, -1)
    assert residuals.shape[-1] == width or case == "spardl"  # SparDL pads to n blocks
    residuals = residuals[..., :width]
  for local in range(num_local):
    np.testing.assert_array_equal(residuals[:, local], models[local]["residuals"])

  # Conservation per node: sum_node m(new) + nodes * update == sum_node (mean + m(old)).
  if mode == "psum":
    node_residuals = residuals[:, 0]
  else:  # the slices' residuals side by side: [nodes, T, N]
    node_residuals = np.concatenate(list(residuals.swapaxes(0, 1)), -1)[..., :NUM_ELEMENTS]
  previous = np.concatenate([np.zeros_like(node_residuals[:, :1]), node_residuals[:, :-1]], 1)
  accumulated = np.sum(node_mean + previous, axis=0, dtype=np.float64)
  kept = np.sum(node_residuals, axis=0, dtype=np.float64) + num_nodes * updates[0, 0]
  np.testing.assert_allclose(kept, accumulated, rtol=1e-5, atol=1e-6)

  # Statistics: n = number of nodes; device (node, l) reports local rank l's model.
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
    got = np.asarray(getattr(stats, name))
    for local in range(num_local):
      if name not in models[local]:
        continue
      for node in range(num_nodes):
        np.testing.assert_array_equal(got[node, local], models[local][name], err_msg=name)
  np.testing.assert_array_equal(stats.step[0, 0], np.arange(1, NUM_STEPS + 1))


def test_the_data_exercise_exdyna():
  """Partitions move and nodes disagree, so the comparisons are not vacuous."""
  for mode in MODES:
    _, _, states, _ = _run("exdyna", "4x2", mode)
    sizes = states.stats.partition_sizes[0, 0]
    assert len({tuple(row) for row in sizes}) > 2, mode
    _, _, states, _ = _run("topk", "4x2", mode)
    k = _k(NUM_ELEMENTS if mode == "psum" else math.ceil(NUM_ELEMENTS / 2))
    assert np.all(states.stats.transmitted[0, 0] > k), mode  # the nodes' top-k differ
  # Scatter mode: the slices keep their own thresholds and partitions.
  _, _, states, _ = _run("exdyna", "2x4", "scatter")
  stats = states.stats
  assert len({tuple(row) for row in stats.selected[0].tolist()}) == 4  # [local, T]
  assert len({tuple(row) for row in stats.threshold[0].tolist()}) > 1
  assert len({tuple(row.ravel()) for row in stats.partition_sizes[0]}) > 1


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


def _axis_groups(mesh_name: str):
  """``(fast, slow)`` replica groups of the mesh: one per node, one per local rank."""
  ids = np.asarray([d.id for d in _mesh(mesh_name).devices.flat]).reshape(MESHES[mesh_name])
  return frozenset(frozenset(r) for r in ids.tolist()), frozenset(
      frozenset(c) for c in ids.T.tolist()
  )


@pytest.mark.parametrize(("case", "mesh_name", "mode"), RUNS)
def test_hlo_sparse_only_across_nodes_dense_only_within(case, mesh_name, mode):
  *_, hlo = _run(case, mesh_name, mode)
  fast, slow = _axis_groups(mesh_name)
  num_local = MESHES[mesh_name][1]

  def within(groups, axis_groups):
    return all(any(g <= a for a in axis_groups) for g in groups)

  ops = collectives(hlo)
  fast_ops = [op for op in ops if within(op[2], fast) and not within(op[2], slow)]
  slow_ops = [op for op in ops if within(op[2], slow) and not within(op[2], fast)]
  assert len(fast_ops) + len(slow_ops) == len(ops), ops  # nothing spans both axes

  if mode == "psum":
    # Within a node: exactly the dense mean of the N-element gradient.
    assert [op[:2] for op in fast_ops] == [("all-reduce", NUM_ELEMENTS)], fast_ops
    width = NUM_ELEMENTS
  else:
    # Within a node: a reduce-scatter of the padded gradient (result: the
    # slice), an all-gather of the slices' updates, and the one-scalar
    # non-finite screen.
    width = math.ceil(NUM_ELEMENTS / num_local)
    assert sorted(op[:2] for op in fast_ops) == [
        ("all-gather", num_local * width),
        ("all-reduce", 1),
        ("reduce-scatter", width),
    ], fast_ops

  # Across nodes: the method's own exchange; sparse (small) unless it is dense.
  assert slow_ops
  small = [op for op in slow_ops if op[1] < width // 2]
  if case == "dense":  # the baseline: dense across nodes too, plus scalars
    assert [op[:2] for op in slow_ops if op not in small] == [("all-reduce", width)]
  else:
    assert small == slow_ops, slow_ops
  kinds = {op[0] for op in slow_ops}
  assert "reduce-scatter" not in kinds
  if case in ("exdyna", "micro", "topk", "hard_threshold"):
    assert {"all-gather", "all-reduce"} <= kinds, kinds
  if case == "spardl":
    assert "collective-permute" in kinds, kinds


# --- Inter-node bytes of the compiled program: scatter mode divides them by L. ---

BIG_SHAPES = {"w": (1024, 1024)}  # N = 2**20, compiled only
BIG_DENSITY = 0.001


def axis_bytes(case: str, mesh_name: str, mode: str) -> dict[str, float]:
  """Bytes one device sends per step over each mesh axis, from the compiled HLO.

  ExDyna's defaults (1024 blocks) at ``d = 0.001`` on ``N = 2**20``; every
  op's ring cost (`exdyna_jax.hlo.ring_cost`) is attributed to the axis its
  group size belongs to (the meshes are not square).
  """
  num_nodes, num_local = MESHES[mesh_name]
  assert num_nodes != num_local
  sparsifier = {
      "exdyna": lambda: exdyna_jax.exdyna(BIG_DENSITY, axis_name=NODE, capacity_factor=1.5),
      "topk": lambda: exdyna_jax.topk(BIG_DENSITY, axis_name=NODE),
      "dense": lambda: exdyna_jax.dense(axis_name=NODE),
  }[case]()
  tx = exdyna_jax.hierarchical(sparsifier, fast_axis=LOCAL, fast_reduce=mode)
  params = {k: jnp.zeros(v, jnp.float32) for k, v in BIG_SHAPES.items()}

  def body(grads):
    grads = jax.tree.map(lambda g: g[0, 0], grads)
    updates, _ = tx.update(grads, tx.init(params), params)
    return jax.tree.map(lambda u: u[None, None], updates)

  spec = P(NODE, LOCAL)
  fn = jax.jit(
      jax.shard_map(body, mesh=_mesh(mesh_name), in_specs=spec, out_specs=spec, check_vma=False)
  )
  abstract = {
      k: jax.ShapeDtypeStruct((num_nodes, num_local, *v), jnp.float32)
      for k, v in BIG_SHAPES.items()
  }
  text = fn.lower(abstract).compile().as_text()
  out = {"node": 0.0, "local": 0.0}
  for op in hlo.collectives(text, num_nodes * num_local):
    assert op.kind != "collective-permute" and op.group_size in (num_nodes, num_local), op
    out["node" if op.group_size == num_nodes else "local"] += op.bytes_sent
  return out


def test_scatter_divides_inter_node_bytes_by_local_devices():
  """ExDyna on 2 nodes x 4 devices, N = 2**20, d = 0.001 (compiled, not run)."""
  num_nodes, num_local = MESHES["2x4"]
  num_elements = math.prod(BIG_SHAPES["w"])
  psum, scatter = axis_bytes("exdyna", "2x4", "psum"), axis_bytes("exdyna", "2x4", "scatter")
  # Per node and step: L devices each repeat the whole exchange (psum), or
  # each send the exchange of one slice (scatter).
  node_psum, node_scatter = num_local * psum["node"], num_local * scatter["node"]
  assert node_psum / node_scatter == pytest.approx(num_local, rel=0.05), (psum, scatter)
  assert node_scatter == pytest.approx(psum["node"], rel=0.05)
  # One ExDyna worker of H: an all-gather of C + 1 indices and an all-reduce of
  # the gathered indices packed into ceil(1.1 k) slots (docs/multihost.md),
  # plus small control messages.
  k = math.floor(BIG_DENSITY * num_elements)
  capacity = math.ceil(1.5 * k / num_nodes)
  slots = min(num_nodes * capacity, math.ceil(1.1 * k))
  one_worker = (num_nodes - 1) * (capacity + 1) * 4 + 2 * (num_nodes - 1) * slots * 4 // num_nodes
  assert one_worker < psum["node"] < one_worker + 200
  # The fast links carry the same: all-reduce = reduce-scatter + all-gather.
  dense_mean = 2 * (num_local - 1) / num_local * 4 * num_elements
  assert psum["local"] == pytest.approx(dense_mean, rel=1e-6)
  assert scatter["local"] == pytest.approx(dense_mean, rel=1e-3)


def test_fast_axis_must_be_bound():
  tx = exdyna_jax.hierarchical(exdyna_jax.topk(DENSITY, axis_name=NODE))
  with pytest.raises(ValueError, match="fast axis 'local' is not bound"):
    jax.vmap(tx.init, axis_name=NODE, axis_size=2)(jnp.zeros((2, 64)))
  with pytest.raises(ValueError, match="fast_axis must be"):
    exdyna_jax.hierarchical(exdyna_jax.dense(), fast_axis="")
  with pytest.raises(ValueError, match="fast_reduce must be one of"):
    exdyna_jax.hierarchical(exdyna_jax.dense(), fast_reduce="mean")


@pytest.mark.parametrize("name", exdyna_jax.available_sparsifiers())
def test_a_sparsifier_over_the_fast_axis_is_refused(name):
  """It would select inside each node only: the nodes would silently drift apart."""
  options = {} if name == "dense" else {"density": DENSITY}
  on_fast = exdyna_jax.get_sparsifier(name, axis_name=LOCAL, **options)
  for mode in MODES:
    with pytest.raises(ValueError, match=r"over 'local', the fast axis.*axis_name='node'"):
      exdyna_jax.hierarchical(on_fast, fast_axis=LOCAL, fast_reduce=mode)
  on_slow = exdyna_jax.get_sparsifier(name, axis_name=NODE, **options)
  exdyna_jax.hierarchical(on_slow, fast_axis=LOCAL)  # the documented way is accepted


def _nested_vmap(fn, num_nodes: int = 2, num_local: int = 2):
  inner = jax.vmap(fn, axis_name=LOCAL, axis_size=num_local)
  return jax.jit(jax.vmap(inner, axis_name=NODE, axis_size=num_nodes))


@pytest.mark.parametrize("mode", MODES)
def test_nested_vmap_and_bfloat16(mode):
  """Simulated 2 x 2 devices with nested vmap; bf16 leaves keep their dtype."""
  tx = exdyna_jax.hierarchical(exdyna_jax.topk(0.25, axis_name=NODE), fast_reduce=mode)
  params = {"w": jnp.zeros((16,), jnp.bfloat16)}
  grads = {"w": jnp.arange(64, dtype=jnp.bfloat16).reshape(2, 2, 16) / 64}

  def device(g):
    updates, state = tx.update(g, tx.init(params), params)
    return updates, state

  updates, state = _nested_vmap(device)(grads)
  assert updates["w"].dtype == jnp.bfloat16
  node_mean = np.asarray(grads["w"], np.float32).mean(axis=1)  # [2 nodes, 16]
  if mode == "psum":
    expected = peers_model.topk(node_mean[:, None, :], 0.25).updates[0]
  else:  # local rank l: Top-k of elements [8l, 8l + 8)
    halves = [peers_model.topk(node_mean[:, None, 8 * r : 8 * r + 8], 0.25) for r in (0, 1)]
    expected = np.concatenate([h.updates[0] for h in halves])
  got = np.asarray(updates["w"], np.float32)
  np.testing.assert_array_equal(got, np.broadcast_to(got[0, 0], got.shape))
  np.testing.assert_allclose(got[0, 0], expected, rtol=1e-2)
  assert int(exdyna_jax.get_stats(state).step[0, 0]) == 1


def test_scatter_skips_the_step_on_every_slice_when_one_is_not_finite():
  """A NaN in one device's gradient stops the whole step, not only its slice."""
  tx = exdyna_jax.hierarchical(exdyna_jax.topk(0.25, axis_name=NODE))
  params = {"w": jnp.zeros((16,), jnp.float32)}
  rng = np.random.default_rng(0)
  first, second = rng.normal(size=(2, 2, 2, 16)).astype(np.float32)
  second[1, 0, 3] = np.nan  # node 1, local 0: only local rank 0's slice [0, 8) sees it

  def device(g1, g2):
    state = tx.init(params)
    _, state = tx.update({"w": g1}, state, params)
    updates, new_state = tx.update({"w": g2}, state, params)
    return updates["w"], state, new_state

  updates, before, after = _nested_vmap(device)(first, second)
  np.testing.assert_array_equal(np.asarray(updates), 0.0)  # every slice skipped
  np.testing.assert_array_equal(after.residual, before.residual)
  stats = exdyna_jax.get_stats(after)
  np.testing.assert_array_equal(stats.skipped_steps, 1)
  np.testing.assert_array_equal(stats.step, 1)
  assert np.all(np.asarray(stats.nonfinite) > 0)


@pytest.mark.parametrize("mode", MODES)
def test_check_vma(mode):
  """shard_map(check_vma=True): psum mode runs (state as a scan carry, params
  replicated); scatter mode's update refuses with the fix, its init runs."""
  mesh = _mesh("4x2")
  tx = optax.chain(
      exdyna_jax.hierarchical(exdyna_jax.topk(0.1, axis_name=NODE), fast_reduce=mode),
      optax.sgd(0.5),
  )
  params = {"w": jnp.zeros((50,), jnp.float32)}
  grads = jnp.asarray(np.random.default_rng(1).normal(size=(4, 2, 3, 50)), jnp.float32)

  def body(params, grads):
    def step(carry, g):
      p, state = carry
      updates, state = tx.update({"w": g}, state, p)
      return (optax.apply_updates(p, updates), state), None

    (params, _), _ = jax.lax.scan(step, (params, tx.init(params)), grads[0, 0])
    return params

  fn = jax.jit(
      jax.shard_map(
          body, mesh=mesh, in_specs=(P(), P(NODE, LOCAL)), out_specs=P(), check_vma=True
      )
  )
  if mode == "scatter":
    with pytest.raises(ValueError, match=r"check_vma=False.*fast_reduce='psum'"):
      fn(params, grads)
    # init alone is fine there (a common way to build the per-device state).
    init = jax.shard_map(
        lambda p: jax.tree.map(lambda s: s[None, None], tx.init(p)),
        mesh=mesh,
        in_specs=P(),
        out_specs=P(NODE, LOCAL),
        check_vma=True,
    )
    state = jax.jit(init)(params)
    assert optax.tree.get(state, "residual").shape == (4, 2, 25)
    return
  final = np.asarray(fn(params, grads)["w"])
  assert np.count_nonzero(final) > 5
  # The same steps simulated with nested vmap (no type tracking) agree.
  reference = _nested_vmap(lambda g: body(params, g[None, None]), 4, 2)(grads)
  np.testing.assert_allclose(final, np.asarray(reference["w"][0, 0]), rtol=1e-6)


def test_scatter_names_the_slice_when_it_is_too_small():
  blocks = exdyna_jax.exdyna(0.01, axis_name=NODE, num_blocks=30_000)
  tx = exdyna_jax.hierarchical(blocks)
  params = {"w": jnp.zeros((40_000,), jnp.float32)}  # enough for 30,000 blocks, not N / 2
  init = _nested_vmap(lambda _: tx.init(params))
  with pytest.raises(ValueError, match=r"slice of ceil\(40000 / 2\) = 20000 elements"):
    jax.eval_shape(init, jnp.zeros((2, 2)))
  psum = exdyna_jax.hierarchical(blocks, fast_reduce="psum")
  jax.eval_shape(_nested_vmap(lambda _: psum.init(params)), jnp.zeros((2, 2)))


@pytest.mark.parametrize("inner", ["sgd", "chain", "hierarchical"])
def test_only_a_sparsifier_itself_is_wrapped(inner):
  """Anything else would let the devices of a node apply different updates."""
  sparsifier = exdyna_jax.topk(DENSITY, axis_name=NODE)
  wrapped = {"sgd": lambda: optax.sgd(0.1),
             "chain": lambda: optax.chain(sparsifier, optax.sgd(0.1)),
             "hierarchical": lambda: exdyna_jax.hierarchical(sparsifier, fast_axis=LOCAL)}[inner]
  with pytest.raises(TypeError, match="wraps one of this package's sparsifiers itself"):
    exdyna_jax.hierarchical(wrapped(), fast_axis=LOCAL)


@pytest.mark.parametrize("mode", MODES)
def test_bfloat16_leaves_lose_nothing_to_rounding(mode):
  """Over 6 steps on 2 x 2 devices, a bfloat16 leaf next to a float32 one: what the
  parameters were owed (the mean gradient) = what was applied + the nodes' mean residual."""
  tx = exdyna_jax.hierarchical(exdyna_jax.topk(0.25, axis_name=NODE), fast_reduce=mode)
  params = {"b": jnp.zeros((9,), jnp.float32), "w": jnp.zeros((40,), jnp.bfloat16)}
  rng = np.random.default_rng(4)
  steps = 6
  grads = {"b": rng.normal(size=(2, 2, steps, 9)).astype(np.float32),
           "w": rng.normal(size=(2, 2, steps, 40)).astype(jnp.bfloat16)}

  def device(g):
    def step(state, g_t):
      updates, state = tx.update(g_t, state, params)
      return state, updates
    return jax.lax.scan(step, tx.init(params), g)

  state, updates = _nested_vmap(device)(grads)
  flat = lambda tree: np.concatenate(  # noqa: E731
      [np.asarray(tree[k], np.float64) for k in ("b", "w")], axis=-1)
  owed = flat(grads).mean(axis=(0, 1)).sum(axis=0)
  applied = flat(updates)[0, 0].sum(axis=0)
  residual = np.asarray(state.residual, np.float64)  # [node, local, slice]
  # Scatter: each local rank holds its slice, the vector is their concatenation.
  residual = residual.reshape(2, -1)[:, :49] if mode == "scatter" else residual[:, 0]
  np.testing.assert_allclose(applied + residual.mean(axis=0), owed, rtol=0, atol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_data_parallel_over_both_axes_runs_it_per_device(mode, tmp_path):
  """``data_parallel(..., axis_name=(node, local))``: one worker per device, the model's updates.

  The state is split over both axes (each device keeps its own residual, as
  the ``shard_map`` recipe does), so an orbax round trip keeps every slice.
  """
  num_nodes, num_local = MESHES["2x4"]
  mesh = _mesh("2x4")
  tx = exdyna_jax.hierarchical(CASES["exdyna"][0](), fast_axis=LOCAL, fast_reduce=mode)
  dp = exdyna_jax.data_parallel(tx, mesh, axis_name=(NODE, LOCAL))
  grads = _flat_gradients(num_nodes, num_local)
  state, updates = dp.init(PARAMS), []
  for t in range(NUM_STEPS):
    worker_grads = unflatten_like(grads[:, :, t].reshape(num_nodes * num_local, -1), PARAMS)
    update, state = dp.update(worker_grads, state, PARAMS)
    updates.append(_to_flat(update, 0))

  models, width = _slice_models("exdyna", grads.mean(axis=1, dtype=np.float32), num_local, mode)
  expected = np.concatenate([m["updates"] for m in models], -1)[:, :NUM_ELEMENTS]
  np.testing.assert_allclose(np.stack(updates), expected, rtol=1e-5, atol=1e-9)
  residual = state.residual
  assert residual.sharding.spec == P((NODE, LOCAL))
  residuals = np.asarray(residual).reshape(num_nodes, num_local, width)
  for local in range(num_local):
    np.testing.assert_array_equal(residuals[:, local], models[local]["residuals"][:, -1])

  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "state", state)
  checkpointer.wait_until_finished()
  restored = checkpointer.restore(
      tmp_path / "state", jax.tree.map(ocp.utils.to_shape_dtype_struct, state))
  chex.assert_trees_all_equal(restored, state)


def test_a_data_parallel_step_over_both_axes_takes_its_state_and_refuses_one_cut_to_fit():
  """``dp.step`` reads a state it did not return on the host before the step: a `hierarchical`
  sparsifier's records the workers of the slow axis (2), not the step's (8), and fits; the
  same state as if made for 6 nodes (no group of the axes has 6 devices) is refused before
  anything runs."""
  tx = optax.chain(exdyna_jax.hierarchical(CASES["exdyna"][0](), fast_axis=LOCAL),
                   optax.sgd(0.1))
  dp = exdyna_jax.data_parallel(tx, _mesh("2x4"), axis_name=(NODE, LOCAL))

  @dp.step
  def step(params, opt_state, batch):
    grads = jax.grad(lambda p: jnp.mean((batch @ p["w"] + p["b"][:1]) ** 2))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  batch, fresh = jnp.ones((8, 32)), lambda: jax.tree.map(jnp.copy, PARAMS)  # steps donate
  params, opt_state = step(fresh(), dp.init(fresh()), batch)  # a fresh state
  params, opt_state = step(params, opt_state, batch)  # the one it returned
  method_state, *rest = dp.init(fresh())
  stats = method_state.stats._replace(num_workers=method_state.stats.num_workers * 3)
  with pytest.raises(ValueError, match="initialized for 6 workers"):
    step(params, (method_state._replace(stats=stats), *rest), batch)


def test_data_parallel_over_the_slow_axis_alone_is_refused():
  """The fast axis left out: its devices would repeat each other's batch, states labelled
  replicated."""
  tx = optax.chain(exdyna_jax.hierarchical(CASES["topk"][0](), fast_axis=LOCAL), optax.sgd(0.1))
  dp = exdyna_jax.data_parallel(tx, _mesh("2x4"), axis_name=NODE)
  with pytest.raises(ValueError, match=r"axis_name=\('node', 'local'\)"):
    dp.init(PARAMS)
  # The same mesh with a sparsifier over 'node' only: the other axis replicates, as documented.
  plain = exdyna_jax.data_parallel(optax.chain(CASES["topk"][0](), optax.sgd(0.1)), _mesh("2x4"),
                                   axis_name=NODE)
  assert plain.init(PARAMS)[0].residual.shape == (MESHES["2x4"][0], NUM_ELEMENTS)


def test_data_axes_the_optimizer_never_exchanges_over_are_refused():
  """A sparsifier over ``node`` alone with both axes named: the workers along ``local`` would
  train apart (dp.update returned their different updates labelled replicated)."""
  mesh = _mesh("2x4")
  tx = optax.chain(CASES["topk"][0](), optax.sgd(0.1))
  with pytest.raises(ValueError, match=r"never exchanges over 'local'.*hierarchical"):
    exdyna_jax.data_parallel(tx, mesh, axis_name=(NODE, LOCAL)).init(PARAMS)
  with pytest.raises(ValueError, match="a tuple of distinct ones"):
    exdyna_jax.data_parallel(tx, mesh, axis_name=(NODE, NODE))
