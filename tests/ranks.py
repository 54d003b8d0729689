"""Run a function on N gloo ranks: :func:`alpha_ckpt.testing.launch.run_ranks` (the harness tests and gates share)."""
from alpha_ckpt.testing.launch import run_ranks

__all__ = ["run_ranks"]
