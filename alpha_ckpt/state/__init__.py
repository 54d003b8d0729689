"""What a state may hold (tensors, NumPy arrays, typed values, Stateful objects, RNG) and how it is matched on load."""
from alpha_ckpt.state.manifest import matches_any
from alpha_ckpt.state.capture import CapturedState, capture_state, is_stateful
from alpha_ckpt.state.load import LoadPlan, plan_load
from alpha_ckpt.state.rng import RNGState
from alpha_ckpt.format.values import RegionRef, decode_value, encode_value

__all__ = ["CapturedState", "capture_state", "is_stateful", "matches_any", "LoadPlan", "plan_load", "RNGState",
           "RegionRef", "decode_value", "encode_value"]
