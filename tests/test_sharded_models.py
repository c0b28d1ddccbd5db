"""Tensor-parallel parameters under ``data_parallel``: sharded over ``model``, sent over ``data``.

On a ``("data", "model")`` mesh, of Auto axes or of Explicit ones (``jax.make_mesh``'s
default), the parameters keep the shardings they arrive with over ``model`` after any
number of steps. On Auto axes every method steps them as it steps the same parameters
replicated (the replicated run is checked against NumPy models elsewhere); on Explicit axes
each device sparsifies its own shards, as the method run on each shard's parts alone, on
a ``(data, model)`` mesh and on an HSDP ``(data, fsdp)`` one. FSDP-style shardings over the
data axis itself are refused, naming the leaf.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import P

import exdyna_jax
from exdyna_jax import hlo

AUTO, EXPLICIT = jax.sharding.AxisType.Auto, jax.sharding.AxisType.Explicit
SPECS = {"w1": P(None, "model"), "w2": P("model", None), "b": P()}


def mesh_of(*types: jax.sharding.AxisType) -> jax.sharding.Mesh:
  return jax.make_mesh((4, 2), ("data", "model"), axis_types=types)


def init_params() -> dict[str, jax.Array]:
  k1, k2 = jax.random.split(jax.random.key(0))
  return {"w1": jax.random.normal(k1, (16, 32)) * 0.3,
          "w2": jax.random.normal(k2, (32, 4)) * 0.3, "b": jnp.zeros(4)}


def loss_fn(params, batch):
  x, y = batch
  hidden = jnp.tanh(x @ params["w1"])
  # On Explicit axes a contraction over the sharded dimension names its output's sharding.
  return jnp.mean((jnp.matmul(hidden, params["w2"], out_sharding=P()) + params["b"] - y) ** 2)


def batches(steps: int):
  key = jax.random.key(1)
  for _ in range(steps):
    key, kx, ky = jax.random.split(key, 3)
    yield jax.random.normal(kx, (16, 16)), jax.random.normal(ky, (16, 4))


def train_step(tx, mesh):
  """``(dp, step)``: ``tx`` wired by `data_parallel`, and its decorated per-worker step."""
  dp = exdyna_jax.data_parallel(tx, mesh)

  @dp.step
  def step(params, opt_state, batch):
    updates, opt_state = tx.update(jax.grad(loss_fn)(params, batch), opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return dp, step


def train(sparsifier, params, mesh, steps=4, sgd=True):
  dp, step = train_step(optax.chain(sparsifier, optax.sgd(0.1)) if sgd else sparsifier, mesh)
  opt_state = dp.init(params)
  for batch in batches(steps):
    params, opt_state = step(params, opt_state, batch)
  return params, dp.stats(opt_state)


def sharded(params, mesh):
  return {name: jax.device_put(leaf, jax.NamedSharding(mesh, SPECS[name]))
          for name, leaf in params.items()}


@pytest.mark.parametrize(("method", "axis_type"), [
    ("dense", AUTO), ("exdyna", AUTO), ("topk", AUTO), ("dense", EXPLICIT)])
def test_tensor_parallel_params_keep_their_shardings_and_step_as_replicated(method, axis_type):
  mesh = mesh_of(axis_type, axis_type)
  sparsifier = lambda: exdyna_jax.get_sparsifier(  # noqa: E731
      method, **({} if method == "dense" else {"density": 0.1}))
  params, stats = train(sparsifier(), sharded(init_params(), mesh), mesh)
  replicated, replicated_stats = train(sparsifier(), init_params(), mesh_of(AUTO, AUTO))
  assert {name: leaf.sharding.spec for name, leaf in params.items()} == SPECS
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
               jax.device_get(params), jax.device_get(replicated))
  np.testing.assert_array_equal(stats.transmitted, replicated_stats.transmitted)
  assert float(jnp.abs(params["w1"] - init_params()["w1"]).max()) > 0


TENSOR_PARALLEL = {"w1": -1, "w2": -2, "b": None}  # the dimension each leaf is split along
HSDP = {"w1": -2, "w2": -1, "b": None}


def shard_parts(tree, shard, shards, split):
  """Shard ``shard`` of ``shards``'s own parts of a tree (leading axes kept), as each device
  of the model axis cuts them: its slice along the dimension ``split`` names, or, of a leaf
  every device holds (``None``), its equal flat part."""
  def part(leaf, dim):
    if dim is None:
      return leaf.reshape(*leaf.shape[:-1], shards, -1)[..., shard, :]
    size = leaf.shape[dim] // shards
    return jax.lax.slice_in_dim(leaf, shard * size, (shard + 1) * size, axis=dim)
  return {name: part(leaf, split[name]) for name, leaf in tree.items()}


def joined(parts, split):
  """The inverse of `shard_parts`: the parts of every shard, concatenated."""
  return {name: jnp.concatenate([part[name] for part in parts], axis=split[name] or -1)
          for name in parts[0]}


def plain_loss(params, batch):
  x, y = batch
  return jnp.mean((jnp.tanh(x @ params["w1"]) @ params["w2"] + params["b"] - y) ** 2)


def per_shard_reference(tx, params, split, shards, workers, steps=4):
  """SGD(0.1) after ``tx`` run on each shard's parts on its own: the method under
  ``jax.vmap`` over the data workers, one state per shard, no mesh."""
  init = jax.vmap(tx.init, in_axes=None, axis_name="data", axis_size=workers)
  update_all = jax.jit(jax.vmap(tx.update, axis_name="data"))
  states = [init(shard_parts(params, shard, shards, split)) for shard in range(shards)]
  transmitted = target = 0
  for x, y in batches(steps):
    grads = jax.vmap(jax.grad(plain_loss), in_axes=(None, 0))(
        params, (x.reshape(workers, -1, 16), y.reshape(workers, -1, 4)))
    parts = []
    for shard in range(shards):
      update, states[shard] = update_all(shard_parts(grads, shard, shards, split), states[shard])
      parts.append(jax.tree.map(lambda leaf: leaf[0], update))
      transmitted += int(states[shard].stats.transmitted[0])
      target += int(states[shard].stats.target[0])
    params = jax.tree.map(lambda p, u: p - 0.1 * u, params, joined(parts, split))
  return params, transmitted, target


@pytest.mark.parametrize(("method", "density", "asked"), [
    ("exdyna", 0.1, 4 * 2 * 32),  # k = floor(0.1 * 322) a shard, each step: 0.1 of the model
    ("topk", 0.1, 4 * 2 * 32),
    ("topk", {0: 0.5, 2: 0.1}, 2 * 2 * 161 + 2 * 2 * 32),  # a density warm-up
])
def test_on_explicit_axes_each_device_sparsifies_its_own_shards(method, density, asked):
  """On ``jax.make_mesh``'s default Explicit axes each device runs the method on its own
  shards (a bias both hold, halved): the run equals each shard's parts stepped on their own,
  the residual is split over ``model`` (no device holds all ``N``), and the stats count the
  whole model."""
  mesh = jax.make_mesh((4, 2), ("data", "model"))
  sparsifier = exdyna_jax.get_sparsifier(method, density=density)
  dp, step = train_step(optax.chain(sparsifier, optax.sgd(0.1)), mesh)
  params = sharded(init_params(), mesh)
  opt_state = dp.init(params)
  residual = optax.tree.get(opt_state, "residual")
  assert residual.shape == (4, 2, 322) and residual.sharding.spec == P("data", "model", None)
  for batch in batches(4):
    params, opt_state = step(params, opt_state, batch)
  expected, transmitted, target = per_shard_reference(
      sparsifier, init_params(), TENSOR_PARALLEL, 2, 4)
  assert {name: leaf.sharding.spec for name, leaf in params.items()} == SPECS
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
               jax.device_get(params), jax.device_get(expected))
  totals = exdyna_jax.read_totals(dp.stats(opt_state))
  assert (totals["transmitted"], totals["target"]) == (transmitted, target)
  assert target == asked
  with pytest.raises(NotImplementedError, match="sharded over Explicit mesh axes"):
    exdyna_jax.resize_workers(dp.tx, opt_state, params, 2)


def hsdp_loss(params, batch):
  """FSDP as Explicit axes write it: the replica's batch split over ``fsdp``, each weight
  gathered where it is used."""
  batch = tuple(jax.sharding.reshard(part, P("fsdp")) for part in batch)
  return plain_loss({**params, **{name: jax.sharding.reshard(params[name], P())
                                  for name in ("w1", "w2")}}, batch)


@pytest.mark.parametrize("density", [0.25, 1.0])
def test_hsdp_shards_are_sparsified_across_the_replicas(density):
  """HSDP on a 2 x 4 ``(data, fsdp)`` mesh: the parameters sharded over ``fsdp`` (the fast axis
  inside a host), each replica's batch split over it too, the replicas over ``data``. XLA
  reduce-scatters each gradient over ``fsdp``; each device sparsifies the shard it holds
  across the replicas: the run equals each shard's parts stepped on their own, and at density
  1 plain data-parallel SGD."""
  mesh = jax.make_mesh((2, 4), ("data", "fsdp"))
  sparsifier = exdyna_jax.exdyna(density)
  tx = optax.chain(sparsifier, optax.sgd(0.1))
  dp = exdyna_jax.data_parallel(tx, mesh)

  @dp.step
  def step(params, opt_state, batch):
    updates, opt_state = tx.update(jax.grad(hsdp_loss)(params, batch), opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  specs = {"w1": P("fsdp", None), "w2": P(None, "fsdp"), "b": P()}
  params = {name: jax.device_put(leaf, jax.NamedSharding(mesh, specs[name]))
            for name, leaf in init_params().items()}
  opt_state = dp.init(params)
  assert optax.tree.get(opt_state, "residual").sharding.spec == P("data", "fsdp", None)
  for batch in batches(4):
    params, opt_state = step(params, opt_state, batch)
  assert {name: leaf.sharding.spec for name, leaf in params.items()} == specs
  expected, _, _ = per_shard_reference(sparsifier, init_params(), HSDP, 4, 2)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
               jax.device_get(params), jax.device_get(expected))


def test_a_bad_value_in_one_shard_skips_the_step_on_every_shard():
  """The guard decides over the shards too: a NaN in shard 1's columns of ``w1`` leaves
  shard 0's parts (and the bias both hold) unchanged as well."""
  mesh = jax.make_mesh((4, 2), ("data", "model"))
  tx = optax.chain(exdyna_jax.exdyna(0.1), optax.sgd(0.1))
  dp = exdyna_jax.data_parallel(tx, mesh)

  @dp.step
  def step(params, opt_state, batch):
    grads = jax.grad(loss_fn)(params, batch)
    nan = jnp.zeros((16, 32)).at[0, 20].set(jnp.nan)  # column 20: shard 1's
    grads = {**grads, "w1": grads["w1"] + jax.sharding.reshard(nan, P(None, "model"))}
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  before = sharded(init_params(), mesh)
  expected = jax.device_get(before)
  params, opt_state = step(before, dp.init(before), next(batches(1)))
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(params), expected)
  assert exdyna_jax.read_totals(dp.stats(opt_state))["skipped_steps"] == 1


def test_density_one_on_sharded_params_is_dense():
  mesh = mesh_of(AUTO, AUTO)
  exact, _ = train(exdyna_jax.exdyna(1.0), sharded(init_params(), mesh), mesh)
  dense, _ = train(exdyna_jax.dense(), sharded(init_params(), mesh), mesh)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), exact, dense)


@pytest.mark.parametrize("axis_type", [AUTO, EXPLICIT])
def test_a_jit_step_of_ones_own_steps_sharded_params_as_the_decorated_step(axis_type):
  """pjit style: ``dp.value_and_grad`` and ``dp.update`` in a ``jax.jit`` of the user's, whose
  ``out_shardings`` keep the parameters' shardings, step as ``dp.step`` does."""
  mesh = mesh_of(axis_type, axis_type)
  tx = optax.chain(exdyna_jax.exdyna(0.1), optax.sgd(0.1))
  dp = exdyna_jax.data_parallel(tx, mesh)
  params = sharded(init_params(), mesh)
  opt_state = dp.init(params)

  @jax.jit(out_shardings=(jax.tree.map(lambda leaf: leaf.sharding, params), None))
  def step(params, opt_state, batch):
    _, worker_grads = dp.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = dp.update(worker_grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  split = jax.NamedSharding(mesh, P("data"))
  for batch in batches(3):
    params, opt_state = step(params, opt_state, jax.device_put(batch, split))
  assert {name: leaf.sharding.spec for name, leaf in params.items()} == SPECS
  expected, _ = train(exdyna_jax.exdyna(0.1), sharded(init_params(), mesh), mesh, steps=3)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
               params, expected)


def test_fsdp_style_shardings_are_refused_naming_the_leaf():
  auto = mesh_of(AUTO, AUTO)
  dp = exdyna_jax.data_parallel(optax.chain(exdyna_jax.exdyna(0.1), optax.sgd(0.1)), auto)
  over_data = jax.device_put(init_params(), jax.NamedSharding(auto, P("data")))
  with pytest.raises(NotImplementedError, match=r"\['b'\] .*data axis.*FSDP"):
    dp.init(over_data)


@pytest.mark.parametrize("wrapper", ["sparse_adamw", "local_steps"])
def test_the_wrappers_keep_explicit_shardings_and_step_as_replicated(wrapper):
  """`sparse_adamw` (its second moment sharded like the parameters) and `local_steps`
  (each worker's own parameters) on ``jax.make_mesh``'s default Explicit axes, their
  sparsifier per shard: at density 1 the run is the replicated one."""
  make = {"sparse_adamw": lambda: exdyna_jax.sparse_adamw(exdyna_jax.exdyna(1.0), 1e-2),
          "local_steps": lambda: exdyna_jax.local_steps(
              optax.sgd(0.1), sync_every=2, compressor=exdyna_jax.exdyna(1.0))}[wrapper]
  mesh = jax.make_mesh((4, 2), ("data", "model"))
  assert mesh.axis_types == (EXPLICIT, EXPLICIT)
  params, _ = train(make(), sharded(init_params(), mesh), mesh, sgd=False)
  replicated, _ = train(make(), init_params(), mesh_of(AUTO, AUTO), sgd=False)
  assert {name: leaf.sharding.spec for name, leaf in params.items()} == SPECS
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
               jax.device_get(params), jax.device_get(replicated))


@pytest.mark.parametrize(("axis_type", "density"), [(AUTO, 0.1), (EXPLICIT, 1.0)])
def test_an_nnx_model_partitioned_with_flax_keeps_its_shardings(axis_type, density):
  """``nnx.with_partitioning`` on a ``(data, model)`` mesh, as Flax's sharding guide writes it,
  stepped by `nnx_optimizer` and `nnx_step`: the same parameters as the replicated model (on
  Explicit axes, where each device sparsifies its own shards, at density 1)."""
  from flax import nnx

  mesh = mesh_of(axis_type, axis_type)

  class MLP(nnx.Module):
    def __init__(self, rngs):
      init = nnx.initializers.lecun_normal()
      self.hidden = nnx.Linear(16, 32, kernel_init=nnx.with_partitioning(init, (None, "model")),
                               rngs=rngs)
      self.out = nnx.Linear(32, 4, kernel_init=nnx.with_partitioning(init, ("model", None)),
                            rngs=rngs)

    def __call__(self, x):  # the contraction over "model" names its output's sharding
      hidden = jnp.tanh(self.hidden(x))
      return jnp.matmul(hidden, self.out.kernel[...], out_sharding=P()) + self.out.bias[...]

  def trained(shard):
    with jax.set_mesh(mesh):
      model = MLP(nnx.Rngs(0))
      state = nnx.state(model)
      nnx.update(model, jax.lax.with_sharding_constraint(state, nnx.get_partition_spec(state))
                 if shard else jax.device_put(state, jax.NamedSharding(mesh, P())))
    tx = optax.chain(exdyna_jax.exdyna(density), optax.sgd(0.1))
    dp = exdyna_jax.data_parallel(tx, mesh)
    optimizer = exdyna_jax.nnx_optimizer(dp, model, wrt=nnx.Param)

    @exdyna_jax.nnx_step(dp)
    def step(model, optimizer, batch):
      x, y = batch
      grads = nnx.grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
      optimizer.update(model, grads)

    for batch in batches(3):
      step(model, optimizer, batch)
    return nnx.state(model, nnx.Param)

  sharded_state, replicated_state = trained(True), trained(False)
  specs = {path: leaf.sharding.spec for path, leaf in nnx.to_flat_state(sharded_state)}
  assert specs[("hidden", "kernel")] == P(None, "model") and specs[("out", "kernel")] == P(
      "model", None)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
               nnx.to_pure_dict(sharded_state), nnx.to_pure_dict(replicated_state))


def test_the_step_lowers_for_abstract_params_as_for_placed_ones():
  """``train_step.lower`` places concrete params as a call does and passes abstract ones
  (``jax.ShapeDtypeStruct``) through: both programs run the same collectives."""
  mesh = mesh_of(AUTO, AUTO)
  dp, step = train_step(optax.chain(exdyna_jax.exdyna(0.1), optax.sgd(0.1)), mesh)

  params = init_params()
  opt_state, batch = dp.init(params), next(batches(1))
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  collectives = [
      [(op.kind, op.result_bytes) for op in hlo.collectives(
          step.lower(p, opt_state, batch).compile().as_text(), mesh.size)]
      for p in (params, abstract)]
  assert collectives[0] == collectives[1] and len(collectives[0]) >= 3


def compiled_collectives(method: str, axis_type: jax.sharding.AxisType) -> list[tuple[str, int]]:
  """``(kind, bytes)`` of each collective in the compiled step of ``chain(method, sgd)``."""
  mesh = mesh_of(axis_type, axis_type)
  sparsifier = exdyna_jax.get_sparsifier(method, **({} if method == "dense" else {"density": 0.1}))
  dp, step = train_step(optax.chain(sparsifier, optax.sgd(0.1)), mesh)
  params = sharded(init_params(), mesh)
  compiled = step.lower(params, dp.init(params), next(batches(1))).compile()
  return [(op.kind, op.result_bytes) for op in hlo.collectives(compiled.as_text(), mesh.size)]


def test_on_explicit_axes_nothing_is_gathered_at_the_data_axis_boundary():
  """The parameters, the batch and the state cross the data axis' ``shard_map`` as they lie
  (JAX 0.10.2 gathers each over a free Explicit axis there): dense runs on Explicit model
  axes the collectives it runs on Auto ones, and ExDyna's per-shard step gathers no
  parameter and no state leaf whole, only what it sends and a replicated leaf's update."""
  assert compiled_collectives("dense", EXPLICIT) == compiled_collectives("dense", AUTO)
  largest_leaf = 16 * 32 * 4  # w1's bytes; a worker's whole residual is larger still
  exdyna = compiled_collectives("exdyna", EXPLICIT)
  assert len(exdyna) <= 8 and max(size for _, size in exdyna) < largest_leaf, exdyna


def test_the_data_axis_type_and_a_model_axis_of_one_device_change_nothing():
  """An Auto data axis beside an Explicit model axis steps as both Explicit; an Explicit
  model axis of one device steps as the params replicated."""
  def trained(shape, types):
    mesh = jax.make_mesh(shape, ("data", "model"), axis_types=types)
    params, _ = train(exdyna_jax.exdyna(0.1), sharded(init_params(), mesh), mesh, steps=3)
    assert {name: leaf.sharding.spec for name, leaf in params.items()} == SPECS
    return params

  for one, other in ((((4, 2), (AUTO, EXPLICIT)), ((4, 2), (EXPLICIT, EXPLICIT))),
                     (((8, 1), (EXPLICIT, EXPLICIT)), ((8, 1), (AUTO, AUTO)))):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
                 trained(*one), trained(*other))


def test_a_state_cut_to_fit_is_stopped_on_explicit_axes_too():
  """The guard's host check where Explicit axes are left to XLA (JAX cannot lower a
  callback there by itself: it runs in a ``shard_map`` of its own over them)."""
  mesh = mesh_of(EXPLICIT, EXPLICIT)
  dp, step = train_step(optax.chain(exdyna_jax.exdyna(0.1), optax.sgd(0.1)), mesh)

  params = sharded(init_params(), mesh)
  method_state, *rest = dp.init(params)
  as_if_for_eight = method_state.stats._replace(num_workers=method_state.stats.num_workers * 2)
  misfit = (method_state._replace(stats=as_if_for_eight), *rest)
  with pytest.raises(Exception, match="initialized for 8 workers but axis 'data' has 4"):
    jax.block_until_ready(step(params, misfit, next(batches(1))))
