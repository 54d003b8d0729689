"""Where tests reach into the product: the points the product calls, and a default that does nothing.

The product calls the installed :class:`Hooks` at fixed places and takes no test-only argument
anywhere else. With the default (:data:`NO_HOOKS`) every call returns at once and changes nothing.
Test support (:mod:`alpha_ckpt.runtime.faults`) installs hooks that kill the process at a stage
of a durable commit, make a tree role send something else up, or kill an owner of the built-in
job after an update; the processes alpha-run starts install them when asked to.
"""
from __future__ import annotations


class Hooks:
    """The product's hook points; subclass and override the ones a test needs."""

    def fault(self, kind: str, point: str) -> None:
        """A named point: a stage of a durable commit (``kind`` the file's kind, ``point`` one of
        :data:`alpha_ckpt.store.durable.FAULT_POINTS`) or ``publish:before-completion``."""

    def tamper(self, role: int, message: dict) -> dict | None:
        """What role ``role`` of a tree publication sends up instead of ``message``; None withholds it."""
        return message

    def after_update(self, rank: int, update: int) -> None:
        """Owner ``rank`` of the built-in job has trained ``update``."""


NO_HOOKS = Hooks()
_installed: Hooks = NO_HOOKS


def installed() -> Hooks:
    """The hooks of this process."""
    return _installed


def install(hooks: Hooks | None) -> Hooks:
    """Make ``hooks`` (None: :data:`NO_HOOKS`) this process's hooks; returns the ones they replace."""
    global _installed
    previous, _installed = _installed, hooks if hooks is not None else NO_HOOKS
    return previous


def fault_point(kind: str, point: str) -> None:
    """A named point where an installed hook may act (kill the process, raise, record)."""
    _installed.fault(kind, point)
