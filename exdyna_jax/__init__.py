"""Communication-efficient data-parallel training in JAX: ExDyna and peers."""

from exdyna_jax._exdyna import exdyna
from exdyna_jax._partitioned import PartitionedState
from exdyna_jax._stats import SparsifierStats, get_stats
from exdyna_jax._threshold import ControllerState

__all__ = [
    "ControllerState",
    "PartitionedState",
    "SparsifierStats",
    "exdyna",
    "get_stats",
]

__version__ = "0.1.0"
