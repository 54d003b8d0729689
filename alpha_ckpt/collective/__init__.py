"""The collective layer: checkpoints of any torch.distributed group's state (never imports the learner)."""
from ..state.placement import Partitioned, PerRank
from .checkpointer import Checkpointer
from .options import CheckpointerOptions
from .result import SaveResult

__all__ = ["Checkpointer", "CheckpointerOptions", "SaveResult", "PerRank", "Partitioned"]
