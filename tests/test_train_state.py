"""Flax ``TrainState`` steps across data-parallel calls: `create_train_state`, `train_state_step`.

A linen step written as for one device (``state.apply_gradients``, a
``batch_stats`` field updated from ``mutable=["batch_stats"]``, a Dropout
key) runs on 8 workers. The reference steps each worker's shard one at a
time and combines the gradients and the BatchNorm statistics by hand.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import struct
from flax.training.train_state import TrainState
from jax import P

import exdyna_jax

WORKERS = 8
LR = 0.1


class Net(nn.Module):
  dropout: float = 0.0

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.5)(nn.Dense(16)(x)))
    return nn.Dense(3)(nn.Dropout(self.dropout, deterministic=not train)(x))


class BatchNormState(TrainState):
  batch_stats: Any
  examples: jax.Array  # a counter of our own: every worker's examples, added up


def batch(seed=0, rows=4 * WORKERS):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(rows, 6)).astype(np.float32)
  return x, (x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 0)


def loss_and_stats(params, batch_stats, apply_fn, batch, key=None):
  x, y = batch
  rngs = {"dropout": key} if key is not None else {}
  logits, updates = apply_fn({"params": params, "batch_stats": batch_stats}, x,
                             mutable=["batch_stats"], rngs=rngs)
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
  return loss, updates["batch_stats"]


def make_step(dp, reduce):
  @exdyna_jax.train_state_step(dp, reduce=reduce)
  def train_step(state, batch):
    grad_fn = jax.value_and_grad(loss_and_stats, has_aux=True)
    (loss, batch_stats), grads = grad_fn(state.params, state.batch_stats, state.apply_fn, batch)
    state = state.apply_gradients(grads=grads, batch_stats=batch_stats,
                                  examples=state.examples + batch[0].shape[0])
    return state, loss

  return train_step


def initial(model):
  variables = model.init(jax.random.key(0), batch()[0], train=False)
  return variables["params"], variables["batch_stats"]


@pytest.fixture(scope="module")
def mesh():
  return jax.make_mesh((WORKERS,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


def new_state(dp, model):
  params, batch_stats = initial(model)
  return exdyna_jax.create_train_state(dp, BatchNormState, apply_fn=model.apply, params=params,
                                       batch_stats=batch_stats, examples=jnp.zeros((), jnp.int32))


def test_a_dense_train_state_step_is_the_mean_over_workers(mesh):
  """params move by the mean gradient, batch_stats are the workers' mean (rule 'mean'),
  a counter adds up every worker's change (rule 'sum'), step counts steps."""
  model = Net()
  dp = exdyna_jax.data_parallel(optax.chain(exdyna_jax.dense(), optax.sgd(LR)), mesh)
  state = new_state(dp, model)
  train_step = make_step(dp, {"batch_stats": "mean", "examples": "sum"})
  params, batch_stats = initial(model)
  for seed in range(3):
    state, losses = train_step(state, batch(seed))
    shards = [jax.tree.map(lambda a, w=w: np.split(a, WORKERS)[w], batch(seed))
              for w in range(WORKERS)]
    outs = [jax.value_and_grad(loss_and_stats, has_aux=True)(params, batch_stats, model.apply, s)
            for s in shards]
    mean = lambda trees: jax.tree.map(lambda *a: np.mean(np.stack(a), axis=0), *trees)  # noqa: E731
    np.testing.assert_allclose(losses, [loss for (loss, _), _ in outs], rtol=1e-5)
    params = jax.tree.map(lambda p, g: p - LR * g, params, mean([g for _, g in outs]))
    batch_stats = mean([stats for (_, stats), _ in outs])
  for got, want in zip(jax.tree.leaves((state.params, state.batch_stats)),
                       jax.tree.leaves((params, batch_stats)), strict=True):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  assert int(state.examples) == 3 * 4 * WORKERS and int(state.step) == 3
  assert int(dp.stats(state.opt_state).step) == 3


def test_a_field_every_worker_advances_alike_is_kept_with_same(mesh):
  """``"same"`` for ``epoch_steps + 1``: 3 after 3 steps on 8 workers (``"sum"`` gave 24)."""
  model = Net()
  dp = exdyna_jax.data_parallel(optax.chain(exdyna_jax.dense(), optax.sgd(LR)), mesh)
  state = new_state(dp, model)

  @exdyna_jax.train_state_step(dp, reduce={"batch_stats": "mean", "examples": "same"})
  def train_step(state, batch):
    grad_fn = jax.value_and_grad(loss_and_stats, has_aux=True)
    (_, batch_stats), grads = grad_fn(state.params, state.batch_stats, state.apply_fn, batch)
    return state.apply_gradients(grads=grads, batch_stats=batch_stats,
                                 examples=state.examples + 1)

  for seed in range(3):
    state = train_step(state, batch(seed))
  assert int(state.examples) == 3 == int(state.step)


class EpochState(TrainState):
  epoch: int = struct.field(pytree_node=False, default=0)


def test_a_step_that_changes_a_static_field_is_told_why_not(mesh):
  """``pytree_node=False`` fields are part of the compiled program: the message says so."""
  model = Net()
  dp = exdyna_jax.data_parallel(optax.chain(exdyna_jax.dense(), optax.sgd(LR)), mesh)
  params, _ = initial(model)
  state = exdyna_jax.create_train_state(dp, EpochState, apply_fn=model.apply, params=params)

  @exdyna_jax.train_state_step(dp)
  def next_epoch(state, batch):
    return state.replace(epoch=state.epoch + 1)

  with pytest.raises(TypeError, match=r"field 'epoch', declared pytree_node=False.*"
                                      r"pytree_node=True.*'same'.*outside the step"):
    next_epoch(state, batch())


def test_the_opt_state_is_per_worker_and_the_rest_replicated(mesh):
  model = Net()
  dp = exdyna_jax.data_parallel(optax.chain(exdyna_jax.exdyna(0.1), optax.sgd(LR)), mesh)
  state = new_state(dp, model)
  train_step = make_step(dp, {"batch_stats": "mean", "examples": "sum"})
  for seed in range(4):
    state, _ = train_step(state, batch(seed))
  residual = optax.tree.get(state.opt_state, "residual")
  assert residual.shape[0] == WORKERS and residual.sharding.spec == P("data")
  assert bool(jnp.any(residual[0] != residual[1]))  # each worker's own
  for leaf in jax.tree.leaves((state.params, state.batch_stats, state.step)):
    assert leaf.sharding.is_fully_replicated
  stats = dp.stats(state.opt_state)
  assert int(stats.step) == 4 and int(stats.transmitted) > 0
  logits = jax.jit(lambda s, x: s.apply_fn({"params": s.params, "batch_stats": s.batch_stats},
                                           x, train=False))(state, batch(9)[0])
  assert logits.shape == (4 * WORKERS, 3) and bool(jnp.all(jnp.isfinite(logits)))


def test_a_dropout_key_folded_with_the_worker_index_draws_a_mask_per_worker(mesh):
  model = Net(dropout=0.5)
  dp = exdyna_jax.data_parallel(optax.chain(exdyna_jax.topk(0.1), optax.sgd(LR)), mesh)
  params, batch_stats = initial(model)
  state = exdyna_jax.create_train_state(dp, apply_fn=model.apply, params=params)

  @exdyna_jax.train_state_step(dp)
  def train_step(state, batch, key):  # key replicated, folded per worker
    key = jax.random.fold_in(jax.random.fold_in(key, state.step), jax.lax.axis_index("data"))
    grads = jax.grad(lambda p: loss_and_stats(p, batch_stats, state.apply_fn, batch, key)[0])(
        state.params)
    mask = nn.Dropout(0.5, deterministic=False).apply({}, jnp.ones(16), rngs={"dropout": key})
    return state.apply_gradients(grads=grads), mask

  state, masks = train_step(state, batch(), jax.random.key(1))
  assert masks.shape == (WORKERS, 16)
  assert len({tuple(np.asarray(m) != 0) for m in masks}) == WORKERS


def test_a_bare_state_returned_comes_back_bare(mesh):
  dp = exdyna_jax.data_parallel(optax.chain(exdyna_jax.exdyna(0.1), optax.sgd(LR)), mesh)
  model = nn.Dense(3)
  state = exdyna_jax.create_train_state(
      dp, apply_fn=model.apply, params=model.init(jax.random.key(0), batch()[0])["params"])

  @exdyna_jax.train_state_step(dp)
  def train_step(state, batch):
    x, y = batch
    loss = lambda p: jnp.mean((state.apply_fn({"params": p}, x) - y[:, None]) ** 2)  # noqa: E731
    return state.apply_gradients(grads=jax.grad(loss)(state.params))

  state = train_step(state, batch())
  assert isinstance(state, TrainState) and int(state.step) == 1
  assert "all-gather" in train_step.lower(state, batch()).as_text(dialect="hlo")


def test_a_changed_field_without_a_rule_is_refused_when_traced(mesh):
  dp = exdyna_jax.data_parallel(optax.chain(exdyna_jax.dense(), optax.sgd(LR)), mesh)
  with pytest.raises(TypeError, match=r"changes the field 'batch_stats'.*reduce=\{'batch_stats'"):
    make_step(dp, {"examples": "sum"})(new_state(dp, Net()), batch())


def test_a_state_not_built_for_dp_is_refused(mesh):
  dp = exdyna_jax.data_parallel(optax.chain(exdyna_jax.dense(), optax.sgd(LR)), mesh)
  model = nn.Dense(3)
  params = model.init(jax.random.key(0), batch()[0])["params"]
  plain = TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(LR))
  step = exdyna_jax.train_state_step(dp)(lambda state, batch: state)
  with pytest.raises(TypeError, match="create_train_state"):
    step(plain, batch())
  with pytest.raises(TypeError, match="must be a flax TrainState"):
    step({"params": params}, batch())


def test_bad_rules_are_refused(mesh):
  dp = exdyna_jax.data_parallel(optax.chain(exdyna_jax.dense(), optax.sgd(LR)), mesh)
  with pytest.raises(ValueError, match="need no rule"):
    exdyna_jax.train_state_step(dp, reduce={"params": "mean"})
  with pytest.raises(ValueError, match="must be one of"):
    exdyna_jax.train_state_step(dp, reduce={"batch_stats": "max"})
  step = make_step(dp, {"batch_stats": "mean", "examples": "sum", "extra": "sum"})
  with pytest.raises(ValueError, match=r"names \['extra'\], not fields of BatchNormState"):
    step(new_state(dp, Net()), batch())
  with pytest.raises(TypeError, match="reduce='mean' for examples of dtype int32"):
    make_step(dp, {"batch_stats": "mean", "examples": "mean"})(new_state(dp, Net()), batch())


def test_a_step_returning_something_else_first_is_refused(mesh):
  dp = exdyna_jax.data_parallel(optax.chain(exdyna_jax.dense(), optax.sgd(LR)), mesh)
  model = nn.Dense(3)
  state = exdyna_jax.create_train_state(
      dp, apply_fn=model.apply, params=model.init(jax.random.key(0), batch()[0])["params"])
  step = exdyna_jax.train_state_step(dp)(lambda state, batch: (jnp.zeros(()), state))
  with pytest.raises(TypeError, match="must return the state it was given"):
    step(state, batch())
