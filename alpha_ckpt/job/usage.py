"""The built-in job's usage check: its flags and its config (alpha-run and every owner run it).

The generic checks (flags a launched script shares, the store) are :mod:`alpha_ckpt.launch.usage`'s;
this is the job's own, so the checks every launch shares do not depend on the job's config.
"""
from __future__ import annotations

import tomllib

from alpha_ckpt.job.learner.config import JobConfig, load_config
from alpha_ckpt.launch.usage import UsageError, check_checkpoint_flags

# The Checkpointer options the job takes (alpha_ckpt/runtime/options.py): it publishes every generation to
# the store (no memory tier), and names its own run, step and identity.
JOB_OPTIONS = ("publisher", "fanout", "commit_timeout", "save", "in_flight", "every", "mtbf", "checkpoint_cost")
MEMORY_OPTIONS = ("memory", "replicas", "durable_every", "mtbf_durable")  # the memory tier's: scripts only


def check_job_args(args, overrides: list[str]) -> JobConfig:
    """The job's config, or :class:`UsageError` naming the first problem in ``args`` or the config.

    ``args`` carries the flags alpha-run and the worker share; ``overrides``
    are the ``KEY=VALUE`` config overrides (alpha-run's ``--run`` among them).
    """
    if args.updates < 1:
        raise UsageError(f"--updates must be at least 1 (the committed update count to reach), not {args.updates}")
    check_checkpoint_flags(args)
    if args.branch_from is not None and not any(o.startswith("run=") for o in overrides):
        raise UsageError("--branch-from needs --set run=NEW_RUN (the new run it starts)")
    if not args.config:
        raise UsageError("the job config path is empty")
    try:
        return load_config(args.config, overrides)
    except OSError as exc:
        raise UsageError(f"config {args.config}: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"config {args.config} is not TOML: {exc}") from None
    except (ValueError, TypeError) as exc:
        raise UsageError(exc) from None
