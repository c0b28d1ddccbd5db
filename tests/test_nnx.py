"""Flax NNX steps across data-parallel calls: `nnx_optimizer` and `nnx_step`.

A step written as for ``nnx.jit`` (it mutates a model with BatchNorm, an
optimizer, metrics and random streams) runs on 8 workers. The reference is
the same model stepped on each worker's shard one at a time, with the
gradients, BatchNorm statistics and metric totals combined by hand.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import P

import exdyna_jax

WORKERS = 8
LR = 0.1


class Net(nnx.Module):
  def __init__(self, rngs: nnx.Rngs, dropout: float = 0.0):
    self.linear = nnx.Linear(6, 16, rngs=rngs)
    self.norm = nnx.BatchNorm(16, momentum=0.5, rngs=rngs)
    self.dropout = nnx.Dropout(dropout, rngs=rngs)
    self.out = nnx.Linear(16, 3, rngs=rngs)

  def __call__(self, x):
    return self.out(self.dropout(nnx.relu(self.norm(self.linear(x)))))


def loss_fn(model, batch):
  logits = model(batch["x"])
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), logits


def batch(seed=0, rows=4 * WORKERS):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(rows, 6)).astype(np.float32)
  return {"x": x, "y": (x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 0)}


@pytest.fixture(scope="module")
def mesh():
  return jax.make_mesh((WORKERS,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


def make_step(dp, reduce):
  @exdyna_jax.nnx_step(dp, reduce=reduce)
  def train_step(model, optimizer, metrics, batch):
    (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, batch)
    metrics.update(loss=loss, logits=logits, labels=batch["y"])
    optimizer.update(model, grads)
    return loss

  return train_step


def reference_step(model, data):
  """The dense data-parallel step, one worker's shard at a time: mean gradient, mean stats."""
  grads, stats, losses, hits = [], [], [], 0
  for shard in range(WORKERS):
    local = nnx.clone(model)
    part = jax.tree.map(lambda a, s=shard: np.split(a, WORKERS)[s], data)
    (loss, logits), grad = nnx.value_and_grad(loss_fn, has_aux=True)(local, part)
    grads.append(nnx.state(grad, nnx.Param))
    stats.append(nnx.state(local, nnx.BatchStat))
    losses.append(float(loss))
    hits += int(np.sum(np.argmax(logits, -1) == part["y"]))
  # jnp, not np: an nnx variable holding a NumPy array is assigned in place, clones and all.
  mean = lambda trees: jax.tree.map(lambda *a: jnp.mean(jnp.stack(a), axis=0), *trees)  # noqa: E731
  params = jax.tree.map(lambda p, g: p - LR * g, nnx.state(model, nnx.Param), mean(grads))
  nnx.update(model, params, mean(stats))
  return np.array(losses), hits


def test_a_dense_nnx_step_is_the_mean_over_workers(mesh):
  """Params move by the mean gradient, BatchNorm statistics are the workers' mean
  (reduce 'mean'), metric totals add up every worker's (reduce 'sum')."""
  model, expected = Net(nnx.Rngs(0)), Net(nnx.Rngs(0))
  dp = exdyna_jax.data_parallel(optax.chain(exdyna_jax.dense(), optax.sgd(LR)), mesh)
  optimizer = exdyna_jax.nnx_optimizer(dp, model, wrt=nnx.Param)
  metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))
  train_step = make_step(dp, {nnx.BatchStat: "mean", nnx.metrics.MetricState: "sum"})
  hits = 0
  for seed in range(3):
    losses = train_step(model, optimizer, metrics, batch(seed))
    want_losses, step_hits = reference_step(expected, batch(seed))
    hits += step_hits
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
  trained = lambda m: jax.tree.leaves(nnx.state(m, nnx.Any(nnx.Param, nnx.BatchStat)))  # noqa: E731
  for got, want in zip(trained(model), trained(expected), strict=True):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  assert int(metrics.accuracy.count[...]) == 3 * 4 * WORKERS  # every example of every worker
  assert float(metrics.accuracy.compute()) == pytest.approx(hits / (3 * 4 * WORKERS))
  assert int(optimizer.step[...]) == 3 and int(dp.stats(optimizer.opt_state).step) == 3


def test_the_optimizer_state_is_per_worker_and_the_model_replicated(mesh):
  model = Net(nnx.Rngs(0))
  dp = exdyna_jax.data_parallel(optax.chain(exdyna_jax.exdyna(0.1), optax.sgd(LR)), mesh)
  optimizer = exdyna_jax.nnx_optimizer(dp, model, wrt=nnx.Param)
  train_step = make_step(dp, {nnx.BatchStat: "mean", nnx.metrics.MetricState: "sum"})
  metrics = nnx.metrics.Average("loss")
  for seed in range(4):
    train_step(model, optimizer, metrics, batch(seed))
  residual = optax.tree.get(nnx.as_pure(optimizer.opt_state), "residual")
  assert residual.shape[0] == WORKERS and residual.sharding.spec == P("data")
  assert bool(jnp.any(residual[0] != residual[1]))  # each worker's own
  kernel = model.linear.kernel[...]
  assert kernel.sharding.is_fully_replicated
  stats = dp.stats(optimizer.opt_state)
  assert int(stats.step) == 4 and int(stats.transmitted) > 0 and int(stats.num_workers) == WORKERS
  model.eval()  # a plain nnx.jit evaluation on the replicated model, no nnx.update needed
  logits = nnx.jit(lambda m, x: m(x))(model, batch(9)["x"])
  assert logits.shape == (4 * WORKERS, 3) and bool(jnp.all(jnp.isfinite(logits)))


def test_each_worker_draws_its_own_dropout_mask(mesh):
  """Keys are folded with the worker index inside the step; the streams leave replicated."""
  model = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=3))
  dp = exdyna_jax.data_parallel(exdyna_jax.dense(), mesh)
  rngs = nnx.Rngs(7)

  @exdyna_jax.nnx_step(dp)
  def kept(model, rngs, x):
    return model(x) != 0, jax.random.bits(rngs())

  first, bits = kept(model, rngs, np.ones((WORKERS, 256), np.float32))
  second, _ = kept(model, rngs, np.ones((WORKERS, 256), np.float32))
  masks = {row.tobytes() for row in np.concatenate([first, second])}
  assert len(masks) == 2 * WORKERS and len(set(bits.tolist())) == WORKERS  # all different
  assert int(model.rngs.count[...]) == 2 and int(rngs.default.count[...]) == 2
  np.testing.assert_array_equal(jax.random.key_data(rngs.default.key[...]),
                                jax.random.key_data(nnx.Rngs(7).default.key[...]))


def test_a_changed_variable_without_a_rule_is_refused(mesh):
  model = Net(nnx.Rngs(0))
  dp = exdyna_jax.data_parallel(optax.chain(exdyna_jax.topk(0.1), optax.sgd(LR)), mesh)
  optimizer = exdyna_jax.nnx_optimizer(dp, model, wrt=nnx.Param)
  train_step = make_step(dp, {nnx.metrics.MetricState: "sum"})
  with pytest.raises(TypeError, match=r"norm.*nnx.BatchStat.*reduce=\{nnx.BatchStat: 'mean'\}"):
    train_step(model, optimizer, nnx.metrics.Average("loss"), batch())


def test_an_optimizer_not_built_for_the_mesh_is_refused(mesh):
  model = Net(nnx.Rngs(0))
  dp = exdyna_jax.data_parallel(optax.chain(exdyna_jax.topk(0.1), optax.sgd(LR)), mesh)
  plain = nnx.Optimizer(model, optax.sgd(LR), wrt=nnx.Param)  # would train on local gradients
  train_step = make_step(dp, {nnx.BatchStat: "mean", nnx.metrics.MetricState: "sum"})
  with pytest.raises(TypeError, match="nnx_optimizer"):
    train_step(model, plain, nnx.metrics.Average("loss"), batch())


@pytest.mark.parametrize("reduce, error", [
    ({nnx.BatchStat: "max"}, ValueError),
    ({"batch_stats": "mean"}, TypeError),
    ({int: "sum"}, TypeError),
    ({nnx.Param: "mean"}, ValueError),  # the exchange keeps them the same already
    ({nnx.RngKey: "sum"}, ValueError),
])
def test_bad_rules_are_refused(mesh, reduce, error):
  dp = exdyna_jax.data_parallel(exdyna_jax.dense(), mesh)
  with pytest.raises(error, match="reduce"):
    exdyna_jax.nnx_step(dp, reduce=reduce)


def test_mean_of_a_counter_is_refused(mesh):
  class Counter(nnx.Module):
    def __init__(self):
      self.seen = nnx.BatchStat(jnp.zeros((), jnp.int32))

  dp = exdyna_jax.data_parallel(exdyna_jax.dense(), mesh)

  @exdyna_jax.nnx_step(dp, reduce={nnx.BatchStat: "mean"})
  def count(counter, x):
    counter.seen[...] += x.shape[0]

  with pytest.raises(TypeError, match=r"'sum' for counts.*'same' for a counter"):
    count(Counter(), np.ones((WORKERS, 2)))


def test_a_counter_every_worker_advances_alike_is_kept_with_same(mesh):
  """``"same"``: a step counter stays the count of steps (``"sum"`` would give n times it);
  a value that depends on each worker's batch stops the step."""
  class Counter(nnx.Module):
    def __init__(self):
      self.steps = nnx.BatchStat(jnp.zeros((), jnp.int32))
      self.last = nnx.BatchStat(jnp.zeros(()))

  dp = exdyna_jax.data_parallel(exdyna_jax.dense(), mesh)

  @exdyna_jax.nnx_step(dp, reduce={nnx.BatchStat: "same"})
  def count(counter, x):
    counter.steps[...] += 1

  counter = Counter()
  for _ in range(3):
    count(counter, np.ones((WORKERS, 2)))
  assert int(counter.steps[...]) == 3

  @exdyna_jax.nnx_step(dp, reduce={nnx.BatchStat: "same"})
  def remember(counter, x):
    counter.last[...] = x.sum()

  with pytest.raises((ValueError, jax.errors.JaxRuntimeError),
                     match=r"reduce='same' for .*last.*the workers' values differ.*'mean'"):
    remember(counter, np.arange(WORKERS * 2, dtype=np.float32).reshape(WORKERS, 2))
    jax.block_until_ready(counter.last[...])


def test_scalars_after_the_batch_reach_every_worker_as_they_are(mesh):
  """A learning-rate scale and a key: every worker gets them whole (not split); a tuple
  holding NNX objects is refused with what to do."""
  model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
  dp = exdyna_jax.data_parallel(optax.chain(exdyna_jax.dense(), optax.sgd(1.0)), mesh)
  optimizer = exdyna_jax.nnx_optimizer(dp, model, wrt=nnx.Param)

  @exdyna_jax.nnx_step(dp)
  def train_step(model, optimizer, x, scale, key):
    noise = jax.random.normal(key, ())  # the same key on every worker
    loss, grads = nnx.value_and_grad(lambda m: scale * (m(x) ** 2).mean())(model)
    optimizer.update(model, grads)
    return loss, noise

  x = np.ones((WORKERS, 2), np.float32)
  before = np.asarray(model.kernel[...])  # a copy: the step donates the model's arrays
  losses, noise = train_step(model, optimizer, x, 0.5, jax.random.key(3))
  expected = 0.5 * float(jnp.mean(nnx.Linear(2, 1, rngs=nnx.Rngs(0))(x[:1]) ** 2))
  np.testing.assert_allclose(losses, np.full(WORKERS, expected), rtol=1e-6)
  np.testing.assert_array_equal(noise, np.full(WORKERS, noise[0]))
  assert not np.allclose(model.kernel[...], before)
  with pytest.raises(TypeError, match=r"Argument 0 of the step is a tuple holding NNX objects.*"
                                       r"an argument of its own"):
    train_step((model, optimizer), x, 0.5, jax.random.key(3))


def test_a_step_that_adds_a_variable_is_refused(mesh):
  dp = exdyna_jax.data_parallel(exdyna_jax.dense(), mesh)

  @exdyna_jax.nnx_step(dp)
  def remember(model, x):
    model.last = nnx.BatchStat(x.mean())

  with pytest.raises(TypeError, match="added or removed nnx variables"):
    remember(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), np.ones((WORKERS, 2), np.float32))
