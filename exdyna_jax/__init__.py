"""Communication-efficient data-parallel training in JAX: ExDyna and peers."""

from exdyna_jax._cltk import cltk
from exdyna_jax._collectives import Sparsifier
from exdyna_jax._dense import DenseState, dense
from exdyna_jax._density_schedule import dgc_warmup
from exdyna_jax._exdyna import ExDynaState, exdyna
from exdyna_jax._feedback import ErrorFeedbackState
from exdyna_jax._hard_threshold import hard_threshold
from exdyna_jax._hierarchical import hierarchical
from exdyna_jax._local_rms import LocalRMSState, scale_by_local_rms, sparse_adamw
from exdyna_jax._local_steps import LocalStepsState, local_steps
from exdyna_jax._micro import micro
from exdyna_jax._network import Network
from exdyna_jax._nnx import nnx_optimizer, nnx_step
from exdyna_jax._registry import available_sparsifiers, get_sparsifier
from exdyna_jax._resize import resize_workers
from exdyna_jax._sharding import DataParallel, data_parallel
from exdyna_jax._spardl import SparDLRounds, SparDLState, spardl
from exdyna_jax._stats import SparsifierStats, get_stats, read_totals
from exdyna_jax._topk import topk
from exdyna_jax._train_state import create_train_state, train_state_step

__all__ = [
    "DataParallel",
    "DenseState",
    "ErrorFeedbackState",
    "ExDynaState",
    "LocalRMSState",
    "LocalStepsState",
    "Network",
    "SparDLRounds",
    "SparDLState",
    "Sparsifier",
    "SparsifierStats",
    "available_sparsifiers",
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
