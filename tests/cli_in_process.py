"""`alpha-ckpt` run inside the test's own process: :func:`alpha_ckpt.testing.launch.alpha_ckpt_cli` (the same
entry point and exit codes as the console script, without an interpreter start and a torch import per call).
The console script itself is tested as a subprocess in tests/unit/test_verify_cli.py."""
from alpha_ckpt.testing.launch import alpha_ckpt_cli

__all__ = ["alpha_ckpt_cli"]
