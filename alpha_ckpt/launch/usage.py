"""Usage errors found before any owner starts: one check shared by alpha-run and every owner.

alpha-run runs the checks of what it launches (:func:`check_checkpoint_flags`, and for the
built-in job :func:`alpha_ckpt.job.usage.check_job_args`) and :func:`check_store_writable` in its
one process, so a bad flag, config key or value, run name or store is one line
and exit 2 instead of a traceback from every owner (or a whole interval
trained before a publish fails). Each owner runs the same checks, so the
worker under plain torchrun answers the same way.
"""
from __future__ import annotations

import argparse

from alpha_ckpt.errors import DurableWriteError, Refusal, StoreUsageError, UsageError  # noqa: F401 (UsageError: its home was here)
from alpha_ckpt.format.records import is_digest
from alpha_ckpt.runtime import options as options_core
from alpha_ckpt.store import Store
from alpha_ckpt.store.location import is_object_store

EXIT_USAGE = 2


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (exit 2), as every other usage error of the job."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: {' '.join(message.split())} (see {self.prog} --help)\n")


def _check_seconds(flag: str, value: float) -> None:
    """The options' one rule for seconds (alpha_ckpt/runtime/options.py), for a launcher flag that is no option."""
    try:
        options_core.positive_seconds(value)
    except ValueError as exc:
        raise UsageError(f"{flag} {exc}") from None


def check_checkpoint_flags(args) -> None:
    """The flags the job and a launched script share: the Checkpointer's options (their one set of rules,
    alpha_ckpt/runtime/options.py), the process groups' timeout, digests."""
    options_core.from_flags(args)
    _check_seconds("--timeout", args.timeout)
    for flag in ("resume_from", "branch_from"):  # the job also takes --branch-from
        value = getattr(args, flag, None)
        if value is not None and not is_digest(value):
            raise UsageError(f"--{flag.replace('_', '-')} needs a full 64-hex root digest, got {value!r}")


def check_store_writable(path: str) -> None:
    """Create and remove a file in STORE/tmp, where every publish starts; :class:`UsageError` if that fails.

    A real write, not a look at permission bits: root writes through those, a
    read-only mount refuses even root. The file is named like a live
    publisher's temporary file (``PID-RANDOM.tmp``), so a gc meanwhile leaves it.
    """
    is_object_store(path)  # a URL no backend serves: its own one-line error, before anything is created
    try:
        with Store(path) as store:  # creates the store's directories, as the owners would
            store.probe_write()
    except OSError as exc:
        raise UsageError(f"store {path} is not writable: {exc.strerror or exc}") from None
    except (DurableWriteError, StoreUsageError, Refusal) as exc:
        raise UsageError(f"store {path} is not writable: {exc}") from None
