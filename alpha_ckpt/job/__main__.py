"""``python -m alpha_ckpt.job CONFIG --updates N ...``: one owner of the forecasting job (under torchrun, or
alpha-run's ``-m alpha_ckpt.job``, which runs it as any module)."""
import os
import sys

from alpha_ckpt.runtime import lifeline

if __name__ == "__main__":
    # First, before torch is imported (seconds): under alpha-run the owner binds its life to the
    # launcher's (alpha_ckpt/runtime/lifeline.py); under plain torchrun, to the agent's.
    lifeline.bind_to_named_launcher()
    lifeline.bind_to_parent()
    from alpha_ckpt.runtime.faults import install_from_environment
    install_from_environment()  # the fault and kill points a test asks of this owner, if any
    from alpha_ckpt.runtime import heartbeat
    heartbeat.start_from_environment()  # beats to alpha-run, which kills an owner whose beats stop (hung)
    from alpha_ckpt.job.owner import main
    exit_code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip C++ static destructors: gloo's threads can otherwise hit std::terminate
    # at interpreter exit ("terminate called without an active exception",
    # SIGABRT) after a run that finished and published correctly.
    os._exit(exit_code)
