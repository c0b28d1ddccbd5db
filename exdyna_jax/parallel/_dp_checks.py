"""What `data_parallel` refuses or warns about in what users hand it.

Each check names the fix. They run outside the compiled step: on the batch
at every call (`check_batch`, a shape test), on the params ``init`` is given
(`refuse_unsupported_shardings`), on the leaves each sparsifier's ``init`` saw
(`refuse_unexchanged_leaves`), on the state ``init`` built
(`warn_if_not_first`, `warn_if_moments_after`, `check_multi_steps`), on a
restored state (`refuse_misfit_state`), and on the replicated params after the
first call (`refuse_per_worker_params`).
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from exdyna_jax.core import _stats
from exdyna_jax.parallel import _mesh_axes
from exdyna_jax.shell import _guard
from exdyna_jax.wrappers import _local_steps
from exdyna_jax.wrappers._local_rms import LocalRMSState


def check_batch(batch: Any, num_workers: int) -> None:
  """Raises unless every leaf of ``batch`` has a leading axis the workers can split.

  Raises:
    TypeError: for a scalar leaf (a Python int, or a list of them).
    ValueError: for a leading axis not divisible by ``num_workers``, or
      leaves with different numbers of rows.
  """
  leaves = jax.tree.leaves(batch)
  rows = {np.shape(leaf)[0] if np.ndim(leaf) else None for leaf in leaves}
  if len(rows) <= 1 and all(np.ndim(leaf) and np.shape(leaf)[0] % num_workers == 0
                            for leaf in leaves):
    return  # every step: no paths formatted
  for path, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]:
    where = f"batch{jax.tree_util.keystr(path)}"
    if np.ndim(leaf) == 0:
      raise TypeError(
          f"{where} is a scalar ({type(leaf).__name__}): every batch leaf is split over the "
          f"{num_workers} workers along its leading axis, so it must be an array of shape "
          "[examples, ...] (a Python list of numbers: jnp.asarray it). Pass per-step "
          "constants after the batch: train_step(params, opt_state, batch, constant)."
      )
    if np.shape(leaf)[0] % num_workers:
      raise ValueError(
          f"{where} has {np.shape(leaf)[0]} rows, which {num_workers} workers cannot split "
          f"evenly: make the global batch a multiple of {num_workers}."
      )
  sizes = ", ".join(f"batch{jax.tree_util.keystr(path)}: {np.shape(leaf)[0]}"
                    for path, leaf in jax.tree_util.tree_flatten_with_path(batch)[0])
  raise ValueError(
      f"The batch's leaves have different numbers of rows ({sizes}): each worker takes its "
      "share of every leaf's rows, so its shares would not match. Give every leaf one row "
      "per example; pass other arrays after the batch: train_step(params, opt_state, "
      "batch, extra)."
  )


def refuse_misfit_state(opt_state: Any, worker_counts: list[int], axis_name: Any, *,
                        last_returned: list[weakref.ref]) -> None:
  """Raises where a restored state (not ``last_returned``) records a count no data axes have:
  the guard's check (exact, in the step), early, where a device it stops cannot stall peers."""
  for first in jax.tree.leaves(opt_state)[:1]:
    if isinstance(first, jax.core.Tracer) or any(ref() is first for ref in last_returned):
      return  # under a jit of the user's (the guard's check), or the state the step returned
  for state in _stats.sparsifier_states(opt_state):
    recorded = state.stats.num_workers  # this process's rows: a fit is a fit on every host
    recorded = [shard.data for shard in getattr(recorded, "addressable_shards", [])] or recorded
    rows = np.concatenate([np.ravel(rows) for rows in jax.device_get(recorded)])
    fits = [count for count in worker_counts if set(rows.tolist()) == {count}]
    _guard.raise_if_state_does_not_fit(rows, np.int32(0), np.int32(0),
                                       num_workers=(fits or worker_counts)[-1],
                                       axis_name=axis_name, leaves="")


def weak_first_leaf(opt_state: Any) -> list[weakref.ref]:
  """A weak reference to the state's first leaf: known at the next call, not kept alive."""
  return [weakref.ref(first) for first in jax.tree.leaves(opt_state)[:1]
          if not isinstance(first, jax.core.Tracer)]


def check_worker_axis(opt_state: Any, num_workers: int) -> None:
  """Raises unless every leaf of the optimizer state has the leading worker axis.

  A value set into the state by hand (``optax.inject_hyperparams``'
  ``state.hyperparams["learning_rate"] = 0.01``, as optax documents it) has
  none, and would fail deep inside ``shard_map``.

  Raises:
    ValueError: naming the first leaf without it, and how to set such a value.
  """
  leaves = jax.tree.leaves(opt_state)
  if all(np.ndim(leaf) and np.shape(leaf)[0] == num_workers for leaf in leaves):
    return  # every step: no paths formatted
  for path, leaf in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
    if not (np.ndim(leaf) and np.shape(leaf)[0] == num_workers):
      raise ValueError(
          f"The optimizer state's leaf opt_state{jax.tree_util.keystr(path)} has shape "
          f"{np.shape(leaf)}: every leaf of a data_parallel state has a leading worker axis of "
          f"{num_workers} (dp.init builds it so). A value set by hand needs it too, e.g. for "
          "optax.inject_hyperparams: opt_state.hyperparams['learning_rate'] = "
          f"jnp.full({num_workers}, 0.01)."
      )


def check_worker_grads(worker_grads: Any, params: Any, num_workers: int) -> None:
  """Raises unless every gradient leaf is ``[n, *param shape]``: one gradient per worker.

  Raises:
    ValueError: naming the first leaf without the worker axis.
  """
  param_leaves = jax.tree.leaves(params) if params is not None else None
  grad_leaves = jax.tree_util.tree_flatten_with_path(worker_grads)[0]
  if param_leaves is not None and len(param_leaves) != len(grad_leaves):
    param_leaves = None  # another tree: the sparsifier names the difference
  for i, (path, leaf) in enumerate(grad_leaves):
    shape = tuple(np.shape(leaf))
    wanted = None if param_leaves is None else (num_workers, *np.shape(param_leaves[i]))
    if shape[:1] == (num_workers,) and wanted in (None, shape):
      continue
    raise ValueError(
        f"dp.update takes every worker's own gradient, stacked on a leading worker axis of "
        f"{num_workers} (as dp.value_and_grad returns them); gradient leaf "
        f"{jax.tree_util.keystr(path)} has shape {shape}"
        + (f", for a parameter of shape {wanted[1:]}" if wanted else "") + ". A gradient "
        "already averaged over the workers has no worker axis and nothing left to "
        "sparsify: take the gradients with dp.value_and_grad, or step with dp.step."
    )


def check_step_outputs(outputs: Any, params: Any, opt_state: Any, step: Any) -> None:
  """Raises unless a per-worker step returned ``(params, opt_state, *aux)`` of its inputs' trees.

  Raises:
    TypeError: for anything but such a tuple; it names a swapped pair.
  """
  name = getattr(step, "__name__", "it")
  if not isinstance(outputs, tuple) or len(outputs) < 2:
    raise TypeError(
        "A step decorated with data_parallel(...).step must return a tuple "
        f"(params, opt_state, *aux); {name} returned {type(outputs).__name__}."
    )
  given = jax.tree.structure(params), jax.tree.structure(opt_state)
  returned = tuple(jax.tree.structure(tree) for tree in outputs[:2])
  if returned == given:
    return
  swapped = returned == given[::-1]
  raise TypeError(
      f"{name} returned {'(opt_state, params)' if swapped else 'a first or second output'}"
      f"{'' if swapped else ' whose tree is not the params or opt_state it was given'}: a "
      "step decorated with data_parallel(...).step returns (params, opt_state, *aux), with "
      "the state tx.update returned."
  )


def refuse_unexchanged_leaves(params: Any, opt_state: Any) -> None:
  """Raises where a parameter's gradient would reach no sparsifier.

  Outside every sparsifier a leaf's gradient stays each worker's own, and
  the replicated params leaving the step would be worker 0's: a silent
  wrong answer. Each sparsifier's state in ``opt_state`` records which
  leaves its ``init`` saw (`_layout.LeavesSeen`: not those ``optax.masked``
  or ``optax.multi_transform`` kept from it).

  Raises:
    ValueError: if ``tx`` holds no sparsifier, or names the leaves none sees.
  """
  records = [getattr(s, "leaves_seen", None) for s in _stats.sparsifier_states(opt_state)]
  if not records:
    raise ValueError(
        "data_parallel(tx, mesh): tx holds no sparsifier, so each worker would train on "
        "its own gradient and the params leaving the step would be worker 0's. Put one "
        "first in the chain: optax.chain(exdyna_jax.exdyna(0.001), optax.sgd(0.1)), or "
        "exdyna_jax.dense() for a plain all-reduce."
    )
  paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  reached = set()
  for record in records:
    if record is None or len(record.seen) != len(paths):
      return  # another tree (a hierarchical slice, say) or no record: cannot tell
    reached |= {i for i, seen in enumerate(record.seen) if seen}
  missed = [jax.tree_util.keystr(path) for i, path in enumerate(paths) if i not in reached]
  if missed:
    raise ValueError(
        f"No sparsifier sees the gradient of {', '.join(missed[:5])}"
        f"{f' and {len(missed) - 5} more' if len(missed) > 5 else ''} (optax.masked or "
        "multi_transform kept it out): each worker would train it on its own gradient and "
        "the params leaving the step would be worker 0's. Exchange those leaves densely: "
        "optax.multi_transform({'sparse': exdyna_jax.exdyna(0.001), 'dense': "
        "exdyna_jax.dense()}, labels), chained before the optimizer."
    )


def differs_across(x: jax.Array, axis_name: str) -> jax.Array:
  """Whether the workers' copies of ``x`` differ (almost surely, if any element does).

  Each worker reduces its copy to two float32 sums, compared bit for bit
  over ``axis_name`` (so NaNs alike on every worker compare equal).
  """
  if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  x = x.astype(jnp.float32)
  bits = jax.lax.bitcast_convert_type(jnp.stack([jnp.sum(x), jnp.sum(x * x)]), jnp.int32)
  return jnp.any(jax.lax.pmax(bits, axis_name) != jax.lax.pmin(bits, axis_name))


def refuse_per_worker_params(differs: Any) -> None:
  """Raises where the workers' copies of the replicated params slot differ.

  The params leave the step replicated: every device holds a copy, and JAX
  takes them to be one value. A step that returns something each worker
  computed for itself (BatchNorm statistics not averaged, a leaf updated
  outside the optimizer) leaves copies that differ, and which one a later
  read sees is arbitrary. `data_parallel` runs this after the first call.

  Args:
    differs: `differs_across` of each params leaf, a tree of bools.

  Raises:
    ValueError: naming the leaves whose copies differ.
  """
  differing = [
      f"params{jax.tree_util.keystr(path)}"
      for path, flag in jax.tree_util.tree_flatten_with_path(jax.device_get(differs))[0]
      if flag
  ]
  if differing:
    raise ValueError(
        f"After the step, the workers hold different values of {', '.join(differing[:5])}"
        f"{f' and {len(differing) - 5} more' if len(differing) > 5 else ''}, which leave "
        "the step replicated: each worker computed its own (BatchNorm statistics not "
        "averaged, a leaf updated outside the optimizer, a per-worker random draw). "
        "Average such values in the step (jax.lax.pmean(x, axis_name)), return them as "
        "an aux output (one per worker), or let a rule do it: exdyna_jax.nnx_step(dp, "
        "reduce={nnx.BatchStat: 'mean'}) with Flax NNX, exdyna_jax.train_state_step(dp, "
        "reduce={'batch_stats': 'mean'}) with a flax TrainState."
    )


def refuse_unsupported_shardings(params: Any, mesh: jax.sharding.Mesh,
                                 data_axes: tuple[str, ...]) -> None:
  """Refuses parameters sharded over a data axis, which ``data_parallel`` cannot step.

  Such parameters (FSDP / ZeRO-3 style) would give each worker a slice of the
  model. Shardings over the mesh's other axes (tensor parallel, Auto or
  Explicit) are kept.
  """
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    sharding = getattr(leaf, "sharding", None)
    if not isinstance(sharding, jax.sharding.NamedSharding) or sharding.mesh != mesh:
      continue
    named = {axis for entry in sharding.spec if entry is not None
             for axis in _mesh_axes.data_axes(entry)}  # a spec entry: a name or a tuple
    if named & set(data_axes):
      raise NotImplementedError(
          f"The parameter {jax.tree_util.keystr(path)} {sharding.spec} is sharded over the data "
          f"axis {sorted(named & set(data_axes))} (FSDP / ZeRO-3 style), which data_parallel "
          "does not support yet: shard parameters over other mesh axes only (tensor parallel, "
          "or HSDP: a ('data', 'fsdp') mesh of Explicit axes, the parameters over 'fsdp'; "
          "docs/usage.md), or replicate them over the data axes.")


def warn_if_not_first(opt_state: Any, params: Any) -> None:
  """Warns when a transform with per-parameter state comes before the sparsifier.

  Such a transform (momentum, Adam's moments, ...) runs on each worker's
  local gradient, and the sparsifier then compresses its output instead of
  the gradient: the chain trains, but not as the method intends. Its state
  shows it: leaves shaped like a parameter before the sparsifier's state in
  the chain's state. (A stateless transform before it, such as clipping,
  leaves no trace; `docs/bad_inputs.md` lists it.)

  Args:
    opt_state: the state ``init`` returned, with the leading worker axis.
    params: the parameters it was built for.
  """
  param_shapes = {np.shape(leaf) for leaf in jax.tree.leaves(params) if np.size(leaf) > 1}
  is_node = lambda node: _stats.is_sparsifier_state(node) or isinstance(node, LocalRMSState)  # noqa: E731
  for path, leaf in jax.tree_util.tree_flatten_with_path(opt_state, is_leaf=is_node)[0]:
    if _stats.is_sparsifier_state(leaf):
      return
    if isinstance(leaf, LocalRMSState):  # sparse_adamw's: meant to precondition the gradient
      continue
    if np.shape(leaf)[1:] in param_shapes:
      warnings.warn(
          "A transform with per-parameter state (at opt_state"
          f"{jax.tree_util.keystr(path)}) runs before the sparsifier: it sees each "
          "worker's local gradient and the sparsifier compresses its output. Put the "
          "sparsifier first: optax.chain(exdyna_jax.exdyna(...), <the rest>).",
          UserWarning,
          stacklevel=3,
      )
      return


def check_multi_steps(opt_state: Any) -> None:
  """Refuses a skip function in ``optax.MultiSteps`` around a sparsifier; warns of its traffic.

  ``MultiSteps`` calls the inner update on every micro-step and keeps its
  result only on the emitting one: the sparsifier exchanges every micro-step
  (``k`` times the traffic) and its stats count the kept exchanges only. A
  ``should_skip_update_fn`` decides on each worker alone: a worker that
  skips falls out of step with the others, whose collectives then wait for
  it (the step hangs), while the sparsifier's own guard already skips a
  non-finite step on every worker together.

  Raises:
    ValueError: for a ``MultiSteps`` with a skip function (a non-empty
      ``skip_state``) around a sparsifier.
  """
  is_multi_steps = lambda node: isinstance(node, optax.MultiStepsState)  # noqa: E731
  for node in jax.tree.leaves(opt_state, is_leaf=is_multi_steps):
    if not is_multi_steps(node) or not _stats.sparsifier_states(node.inner_opt_state):
      continue
    if jax.tree.leaves(node.skip_state):
      raise ValueError(
          "optax.MultiSteps(..., should_skip_update_fn=...) around a sparsifier: each worker "
          "decides alone whether to skip, and a worker that skips falls out of step with the "
          "others (their exchange waits for it). The sparsifier already skips a step with a "
          "non-finite gradient on every worker together (stats.nonfinite, "
          "stats.skipped_steps): drop should_skip_update_fn."
      )
    warnings.warn(
        "optax.MultiSteps around a sparsifier runs it, exchange included, on every "
        "micro-step and keeps the result of the emitting one only: k times the traffic, and "
        "the stats count only the kept exchanges. Accumulate the micro-batches' gradients "
        "inside your step instead and update once (docs/usage.md, 'Gradient accumulation').",
        UserWarning,
        stacklevel=3,
    )


MOMENT_FIELDS = ("trace", "mu", "nu")  # optax's momentum trace, Adam's (and its kin's) moments


def warn_if_moments_after(opt_state: Any) -> None:
  """Warns when momentum or Adam's moments follow a sparsifier that sends a fraction.

  What such a transform sees is what error feedback releases: a coordinate's
  residual, many steps of gradient, at once. Momentum keeps pushing that
  burst while the residual refills, and Adam turns each burst into a step
  of about ``lr / sqrt(1 - b2)``: the digits MLP of the README reached 54 %
  test accuracy with ``sgd(0.1, momentum=0.9)`` after ``exdyna(0.001)``
  and 53 % with ``adamw(1e-3)``, against 97 % and 96 % without the
  sparsifier (`docs/usage.md`). Under `local_steps` the same holds for the
  outer optimizer after a sparse compressor; its inner optimizer runs
  before the exchange and is not concerned. ``dense()`` sends everything,
  so nothing after it is.

  Args:
    opt_state: the state ``init`` returned.
  """
  sparse = None
  for node in _in_exchange_order(opt_state):
    if _stats.is_sparsifier_state(node):
      sparse = sparse or ("residual" in node._fields and type(node).__name__)
    elif sparse:
      warnings.warn(
          f"{type(node).__name__} (momentum or Adam's moments) follows a sparsifier "
          f"({sparse}): it gets the bursts error feedback releases and trains far worse "
          "than without the sparsifier. Use exdyna_jax.sparse_adamw(sparsifier, lr) in place "
          "of chain(sparsifier, adamw(lr)), best with sparsifier = exdyna_jax.chunked_topk("
          "exdyna_jax.dgc_warmup(6 * d / n, steps_per_level=10, start=0.125), value_bits=2) on "
          "n workers and twice the rate; for momentum SGD, drop the momentum and scale the "
          "learning rate by 1 / (1 - momentum), clipping each worker's gradient first: "
          "chain(optax.clip_by_global_norm(1.0), sparsifier, optax.sgd(lr / (1 - momentum))), "
          "the residual carrying the momentum (docs/usage.md, 'Momentum and Adam with a "
          "sparsifier'). optax.sgd(lr, momentum=0.0) keeps a trace too: pass momentum=None. "
          "Under local_steps with a sparse compressor, keep the default outer=optax.sgd(1.0).",
          UserWarning,
          stacklevel=3,
      )
      return


def _in_exchange_order(opt_state: Any):
  """The sparsifier states and moment-holding states of ``opt_state``, in chain order.

  A `LocalStepsState` stands for its compressor then its outer optimizer
  (its inner optimizer runs before the exchange).
  """
  def is_node(node):
    return (_stats.is_sparsifier_state(node) or _local_steps.is_local_steps_state(node)
            or (isinstance(node, tuple) and any(f in getattr(node, "_fields", ())
                                                for f in MOMENT_FIELDS)))

  for node in jax.tree.leaves(opt_state, is_leaf=is_node):
    if _local_steps.is_local_steps_state(node):
      yield from _in_exchange_order((node.compressor, node.outer))
    elif is_node(node):
      yield node
