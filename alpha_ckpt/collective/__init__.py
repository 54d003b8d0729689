"""The collective layer: checkpoints of any torch.distributed group's state (never imports the learner)."""
from alpha_ckpt.state.placement import Partitioned, PerRank
from alpha_ckpt.collective.checkpointer import Checkpointer
from alpha_ckpt.collective.options import CheckpointerOptions
from alpha_ckpt.collective.result import SaveResult

__all__ = ["Checkpointer", "CheckpointerOptions", "SaveResult", "PerRank", "Partitioned"]
