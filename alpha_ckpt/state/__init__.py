"""What a state may hold (tensors, NumPy arrays, typed values, Stateful objects, RNG) and how it is matched on load."""
from ..manifest import matches_any
from .capture import CapturedState, capture_state, is_stateful
from .load import LoadPlan, plan_load
from .rng import RNGState
from ..values import RegionRef, decode_value, encode_value

__all__ = ["CapturedState", "capture_state", "is_stateful", "matches_any", "LoadPlan", "plan_load", "RNGState",
           "RegionRef", "decode_value", "encode_value"]
