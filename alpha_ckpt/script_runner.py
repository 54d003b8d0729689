"""Run a user's training script as one rank, with alpha_ckpt's exit codes (what alpha-run starts per rank).

    python -m alpha_ckpt.script_runner train.py --its --own --args
    python -m alpha_ckpt.script_runner -m package.module --args

The script runs as ``__main__`` with its own argv, exactly as ``python
train.py`` would run it under torchrun. A :class:`~alpha_ckpt.Refusal` that
escapes it exits 3 with one line naming the code (a checkpoint refused: an
orchestrator must not retry); ``SystemExit`` keeps its code (argparse's usage
errors are 2); any other exception exits 1 with its traceback, which
alpha-run reports as retryable (75).
"""
from __future__ import annotations

import os
import runpy
import sys

EXIT_REFUSED = 3


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0] == "-m" and len(argv) < 2):
        print("alpha_ckpt.script_runner: usage: SCRIPT [ARGS...] | -m MODULE [ARGS...]", file=sys.stderr)
        return 2
    from .errors import Refusal
    module = argv[0] == "-m"
    target = argv[1] if module else argv[0]
    sys.argv = [target] + argv[(2 if module else 1):]
    try:
        if module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(target)))  # as `python train.py` does
            runpy.run_path(target, run_name="__main__")
    except Refusal as refusal:
        print(f"alpha-run: checkpoint refused: [{refusal.code.value}] {refusal.message}", file=sys.stderr)
        _leave_group()
        return EXIT_REFUSED
    _leave_group()
    return 0


def _leave_group() -> None:
    """A process group left alive at exit aborts the process (gloo's threads): a refusal would read as a crash."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
