"""Communication-efficient data-parallel training in JAX: ExDyna and peers."""

from typing import TYPE_CHECKING, Any

from exdyna_jax.core._collectives import Sparsifier
from exdyna_jax.core._stats import SparsifierStats, get_stats, read_totals
from exdyna_jax.exchange._network import Network
from exdyna_jax.methods._chunked_topk import QuantizedMeanState, chunked_topk
from exdyna_jax.methods._cltk import cltk
from exdyna_jax.methods._dense import DenseState, dense
from exdyna_jax.methods._hard_threshold import hard_threshold
from exdyna_jax.methods._micro import micro
from exdyna_jax.methods._registry import available_sparsifiers, get_sparsifier
from exdyna_jax.methods._spardl import SparDLRounds, SparDLState, spardl
from exdyna_jax.methods._topk import SteeredTopKState, topk
from exdyna_jax.methods.exdyna._exdyna import ExDynaState, exdyna
from exdyna_jax.parallel._resize import resize_workers
from exdyna_jax.parallel._sharding import DataParallel, data_parallel
from exdyna_jax.shell._density_schedule import dgc_warmup
from exdyna_jax.shell._feedback import ErrorFeedbackState
from exdyna_jax.wrappers._hierarchical import hierarchical
from exdyna_jax.wrappers._local_rms import LocalRMSState, scale_by_local_rms, sparse_adamw
from exdyna_jax.wrappers._local_steps import LocalStepsState, local_steps

if TYPE_CHECKING:
  from exdyna_jax.parallel._nnx import nnx_optimizer, nnx_step
  from exdyna_jax.parallel._train_state import create_train_state, train_state_step


def __getattr__(name: str) -> Any:
  """The Flax helpers, imported on first use: ``import exdyna_jax`` alone loads no Flax."""
  if name in ("nnx_optimizer", "nnx_step"):
    from exdyna_jax.parallel import _nnx
    return getattr(_nnx, name)
  if name in ("create_train_state", "train_state_step"):
    from exdyna_jax.parallel import _train_state
    return getattr(_train_state, name)
  raise AttributeError(f"module 'exdyna_jax' has no attribute {name!r}")


def __dir__() -> list[str]:
  return sorted({*globals(), *__all__})


__all__ = [
    "DataParallel",
    "DenseState",
    "ErrorFeedbackState",
    "ExDynaState",
    "LocalRMSState",
    "LocalStepsState",
    "Network",
    "QuantizedMeanState",
    "SparDLRounds",
    "SparDLState",
    "Sparsifier",
    "SparsifierStats",
    "SteeredTopKState",
    "available_sparsifiers",
    "chunked_topk",
    "cltk",
    "create_train_state",
    "data_parallel",
    "dense",
    "dgc_warmup",
    "exdyna",
    "get_sparsifier",
    "get_stats",
    "hard_threshold",
    "hierarchical",
    "local_steps",
    "micro",
    "nnx_optimizer",
    "nnx_step",
    "read_totals",
    "resize_workers",
    "scale_by_local_rms",
    "spardl",
    "sparse_adamw",
    "topk",
    "train_state_step",
]

__version__ = "0.4.0"
