"""Every checkpoint option, spelled once: its name, default, meaning, rule, and alpha-run's flag for it.

What is built from :data:`OPTIONS`, so that an option added here reaches all of them:

- :class:`alpha_ckpt.collective.options.CheckpointerOptions` and the keyword arguments of
  :class:`alpha_ckpt.Checkpointer` (one per option, checked by :func:`check`);
- alpha-run's flags (:func:`add_flags`), checked by the same rules, spelled as flags (:func:`from_flags`);
- the hand-off from alpha-run to its ranks: one variable holding the options as JSON
  (:func:`alpha_ckpt.runtime.launch_env.script_environment`, read back by
  :func:`~alpha_ckpt.runtime.launch_env.launcher_settings`);
- the built-in job's command line (:func:`to_argv`).

A rule raises ValueError naming the value; :func:`check` turns it into a :class:`UsageError` naming the
option as the caller spells it (``fanout=`` for a keyword, ``--fanout`` for alpha-run). Only the standard
library and the layers below are imported: alpha-run checks its flags before torch is imported.
"""
from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from alpha_ckpt.errors import Refusal, UsageError
from alpha_ckpt.format.records import check_json_value, check_name, is_digest
from alpha_ckpt.format.values import encode_value
from alpha_ckpt.runtime.interval import parse_duration



@dataclass(frozen=True)
class Option:
    """One option. ``check(value)``: the value normalized, or ValueError (None is always the default's
    business: a rule sees None only where None is allowed). ``flag``: alpha-run's flag, or None (a script's
    keyword only); ``parse(text)``: a flag's text to a value; ``switch``: the flag takes no value."""

    name: str
    default: Any
    doc: str
    check: Callable[[Any], Any] | None = None
    flag: str | None = None
    parse: Callable[[str], Any] | None = None
    metavar: str | None = None
    switch: bool = False
    none_is_a_value: bool = False  # None given means None (resume=None: a fresh start), not the default

    def spelled(self, as_flag: bool, value: Any = None) -> str:
        """The option as its caller writes it: ``--checkpoint-every`` or ``every=`` (with ``value``:
        ``--checkpoint-every auto`` or ``every='auto'``)."""
        if as_flag and self.flag:
            return self.flag if value is None else f"{self.flag} {value}"
        return f"{self.name}=" if value is None else f"{self.name}={value!r}"


# ---------------------------------------------------------------------------------------------- rules


def one_of(*choices: str) -> Callable[[Any], str]:
    def rule(value: Any) -> str:
        if value not in choices:
            raise ValueError(f"is {' or '.join(repr(c) for c in choices)}, not {value!r}")
        return value
    rule.choices = choices  # type: ignore[attr-defined]
    return rule


def whole_at_least(low: int) -> Callable[[Any], int]:
    def rule(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"is a whole number of at least {low}, not {value!r}")
        return value
    return rule


# Longer waits are no job's intent, and the derived waits (a tree's parent waits one timeout per level)
# must stay within what timedelta and thread waits accept.
MAX_SECONDS = 365 * 86400.0


def positive_seconds(value: Any) -> float:
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = math.nan
    if isinstance(value, bool) or not (0 < seconds <= MAX_SECONDS):
        raise ValueError(f"is a positive number of seconds, at most {MAX_SECONDS:.0f}, not {value!r}")
    return seconds


def duration(value: Any) -> float | str:
    """Seconds (a positive number) or a duration's text ("6h"): kept as given once it is one."""
    if isinstance(value, str):
        parse_duration(value)
        return value
    return positive_seconds(value)


def pattern_list(patterns: Any, what: str = "patterns") -> tuple[str, ...]:
    """A parameter that takes fnmatch patterns (``allow_nonfinite``): a bare string is ONE pattern
    (``"*.mask"``, never the patterns ``*``, ``.``, ``m``, ...); ValueError for anything but strings."""
    if isinstance(patterns, str):
        return (patterns,)
    if isinstance(patterns, (bytes, Mapping)):
        raise ValueError(f"{what} is a pattern or a list of patterns, not {type(patterns).__name__}")
    try:
        out = tuple(patterns)
    except TypeError:
        raise ValueError(f"{what} is a pattern or a list of patterns, not {patterns!r}") from None
    bad = [p for p in out if not isinstance(p, str)]
    if bad:
        raise ValueError(f"{what}: patterns are strings, not {bad[0]!r}")
    return out


def allowed_changes(value: Any, what: str = "allow_optimizer_change") -> tuple[tuple[str, str], ...]:
    """``[("Adam", "AdamW"), ...]``: (saved class, destination class) name pairs; ValueError otherwise."""
    if isinstance(value, (str, bytes, Mapping)):
        raise ValueError(f"{what} is a list of (saved class, destination class) name pairs, such as "
                         f"[('Adam', 'AdamW')], not {value!r}")
    try:
        pairs = tuple(value)
    except TypeError:
        raise ValueError(f"{what} is a list of (saved class, destination class) name pairs, not {value!r}") from None
    out = []
    for pair in pairs:
        if (not isinstance(pair, (tuple, list)) or len(pair) != 2
                or not all(isinstance(n, str) and n.isidentifier() for n in pair)):
            raise ValueError(f"{what}: each entry is a pair of class names, such as ('Adam', 'AdamW'), not {pair!r}")
        out.append((pair[0], pair[1]))
    return tuple(out)


def _name(what: str) -> Callable[[Any], str]:
    def rule(value: Any) -> str:
        check_name(value, what)
        return value
    return rule


def _store(value: Any) -> Any:
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if value is None or (isinstance(value, str) and not value):
        raise ValueError("is the store's directory (or an open Store)")
    return value


def _identity(value: Any) -> Any:
    encode_value(value, "identity")  # a typed value (tuples, int keys, floats exact): refused here, not at a save
    return value


def _every(value: Any) -> int | str | None:
    if value == "auto" or value is None:
        return value
    return whole_at_least(1)(value)


def _every_flag(text: str) -> int | str | None:
    """--checkpoint-every: K updates, 'auto', or 0 (the script decides: no schedule)."""
    if text == "auto":
        return "auto"
    if not (text.isascii() and text.isdigit()):
        raise ValueError(f"takes a number of updates or 'auto', not {text!r}")
    return int(text) or None


def _memory(value: Any) -> bool | str | None:
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if value is False:
        return None
    if value is None or value is True or (isinstance(value, str) and value):
        return value
    raise ValueError(f"is None, True or the directory of the ranks' holders, not {value!r}")


def _metadata(value: Any) -> dict:
    metadata = dict(value or {})
    check_json_value(metadata, "metadata")  # what a restore reads back is what was given
    if set(metadata) & RECORDED_METADATA:
        raise ValueError("may not set identity, owners, devices, layout or placement_patterns (the Checkpointer "
                         "records them)")
    return metadata


def _resume(value: Any) -> str | None:
    if not (value is None or value == "latest" or is_digest(value)):
        raise ValueError(f"is 'latest', a full 64-hex root digest or None, not {value!r}")
    return value


def _flag(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"is True or False, not {value!r}")
    return value


# What a root manifest's metadata records of its own (metadata= may not set these); "placement_patterns"
# is alpha_ckpt.state.rules.METADATA_KEY (a test keeps the two the same).
RECORDED_METADATA = frozenset({"identity", "owners", "devices", "layout", "placement_patterns"})


# ---------------------------------------------------------------------------------------------- the options

OPTIONS: tuple[Option, ...] = (
    Option("store", None, "The store directory (created by rank 0 if absent), or an open Store (the caller's).",
           _store),
    Option("run", None, "The run's name: a plain path component. Every generation of the run continues one history.",
           _name("run")),
    Option("step", "train", 'The step\'s name within the run ("train", "fit").', _name("step")),
    Option("publisher", "star", '"star": rank 0 hears every rank and writes one root manifest; "tree": group '
           "manifests up a tree of fanout children per parent (many ranks).", one_of("star", "tree"),
           flag="--publisher"),
    Option("fanout", 8, "Tree: children per parent at most.", whole_at_least(1), flag="--fanout", parse=int),
    Option("commit_timeout", 60.0, "Tree: seconds a parent waits for its children's commitments.", positive_seconds,
           flag="--commit-timeout", parse=float, metavar="SECONDS"),
    Option("save_timeout", None, "Seconds a save may take to write its objects and ref, or None (no bound of its "
           "own). Past it, what is still being written is abandoned (an upload to an object store is aborted), "
           "the save fails on every rank naming the rank, the object and the error, and nothing of it is "
           "resumable. alpha-run's --timeout bounds how long a rank waits for its peers; this bounds the writes. "
           "An async save's failure reaches the next save or wait.", lambda v: v if v is None else positive_seconds(v),
           flag="--save-timeout", parse=float, metavar="SECONDS"),
    Option("save", "sync", '"sync": save returns once the generation is durable; "async": it snapshots the tensors '
           "and publishes in the background.", one_of("sync", "async"), flag="--save"),
    Option("in_flight", "wait", 'Async: a save called while the previous one is in flight waits for it ("wait") or '
           'is skipped on every rank ("skip").', one_of("wait", "skip"), flag="--in-flight"),
    Option("identity", None, "The learner's identity (a typed value: model, hyperparameters), recorded in every "
           "root manifest; a restore of a generation saved with another is refused foreign-learner.", _identity),
    Option("allow_nonfinite", (), "Entries (fnmatch patterns on dotted names; a bare string is one pattern) that "
           "may hold NaN or inf; any other non-finite tensor refuses the save non-finite.",
           lambda v: pattern_list(v, "allow_nonfinite")),
    Option("every", None, 'What due() answers: every K updates, "auto" (Young/Daly\'s interval, needs mtbf), or None '
           "(the script decides).", _every, flag="--checkpoint-every", parse=_every_flag, metavar="K|auto"),
    Option("mtbf", None, 'every="auto": the mean time between failures (seconds, or "6h").', duration,
           flag="--mtbf", metavar="DURATION"),
    Option("checkpoint_cost", None, 'every="auto": the checkpoint cost assumed until one is measured (with memory: '
           "a durable save's).", duration, flag="--checkpoint-cost", metavar="DURATION"),
    Option("memory", None, "The memory tier: None or False: none, every save goes to the store; True: each rank "
           "holds the generations in host memory, replicated to replicas peers, and one save in durable_every "
           "also goes to the store; a str: the directory (tmpfs) holding the ranks' holders. alpha-run's --memory "
           "makes that directory for its launch.", _memory, flag="--memory", switch=True),
    Option("replicas", 1, "With memory: the peer ranks that hold a copy of each rank's objects besides itself (at "
           "least 1, so every object is held by at least two ranks).", whole_at_least(1), flag="--replicas",
           parse=int),
    Option("durable_every", None, 'With memory: one save in this many also goes to the store (the first save, then '
           'the K-th after each durable one). None: planned with every="auto", else 5. Without memory: None or 1.',
           lambda v: v if v is None else whole_at_least(1)(v), flag="--durable-every", parse=int, metavar="K"),
    Option("mtbf_durable", None, 'every="auto" with memory: the mean time between the failures the memory tier does '
           'not survive (a node\'s or the whole job\'s loss; seconds, or "30d"), which plans durable_every. None: '
           "ten times mtbf.", duration, flag="--mtbf-durable", metavar="DURATION"),
    Option("keep", None, "Retention: after each publish rank 0 keeps the keep newest complete generations (at least "
           "2, so the previous complete generation survives a failed save), or all (None).",
           lambda v: v if v is None else whole_at_least(2)(v)),
    Option("metadata", {}, "The script's own JSON values, recorded in every root manifest (Counters.metadata on "
           "restore).", _metadata),
    Option("bind_devices", False, "Each rank's device must be the very one (UUID) that saved its rank, not only the "
           "same product.", _flag),
    Option("per_rank", (), "Entries (patterns) stored per rank and restored to the same rank (BatchNorm statistics "
           "under DDP).", lambda v: pattern_list(v, "per_rank")),
    Option("from_rank0", (), "Entries (patterns) saved from rank 0 alone and restored to every rank.",
           lambda v: pattern_list(v, "from_rank0")),
    Option("resume", "latest", 'What restore(state) resumes without a root: "latest" (the newest complete generation '
           "that is not stale; none yet: a fresh start), a root digest (exactly that one, or a refusal), or None "
           "(a fresh start, refused fenced when the run already has history).", _resume, none_is_a_value=True),
    Option("allow_optimizer_change", (), '(saved class, destination class) names of optimizers a restore may change '
           'between, such as [("Adam", "AdamW")]: only between classes of the same hyperparameters.',
           allowed_changes),
    Option("announce", False, "Rank 0 says on stderr, in one line, what each restore resumed (or that it starts "
           "fresh): alpha-run's scripts do.", _flag),
    Option("share_reads", True, "Restore from the store: an object several ranks of a node need (replicated state) "
           "is read once per node, by one of them, and mapped by the others from the node's shared memory; False: "
           "every rank reads all it restores.", _flag),
)


def by_name() -> dict[str, Option]:
    return {o.name: o for o in OPTIONS}


def defaults() -> dict[str, Any]:
    return {o.name: o.default for o in OPTIONS}


def check(given: Mapping[str, Any], *, as_flags: bool = False) -> dict[str, Any]:
    """Every option, ``given`` ones checked and normalized, the others their defaults; then the rules
    between options. :class:`UsageError` naming the option as the caller spells it (``as_flags``: alpha-run's
    flag) for an unknown option or a value that cannot be."""
    options = by_name()
    unknown = sorted(set(given) - set(options))
    if unknown:
        raise UsageError(f"unknown option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} (the options: "
                         f"{', '.join(options)})")
    values = defaults()
    for name, value in given.items():
        option = options[name]
        if value is None and not option.none_is_a_value:
            continue  # None: the option's default
        try:
            values[name] = option.check(value) if option.check is not None else value
        except (ValueError, TypeError, Refusal) as exc:
            text = exc.message if isinstance(exc, Refusal) else str(exc)
            raise UsageError(f"{option.spelled(as_flags)} {text}" if text.startswith("is ") or
                             text.startswith("takes ") else f"{option.spelled(as_flags)}: {text}") from None
    problem = schedule_problem(values, lambda name, value=None: options[name].spelled(as_flags, value))
    if problem:
        raise UsageError(problem)
    return values


def schedule_problem(values: Mapping[str, Any], spell: Callable[..., str]) -> str | None:
    """The rules between the schedule's options and the memory tier's (None: they hold); ``spell(name,
    value=None)`` writes an option as the caller does. Pure."""
    every, memory, auto = values["every"], values["memory"] is not None, spell("every", "auto")
    if every != "auto":
        if values["mtbf"] is not None or values["checkpoint_cost"] is not None:
            return f'{spell("mtbf")} and {spell("checkpoint_cost")} go with {auto}'
        if values["mtbf_durable"] is not None:
            return f'{spell("mtbf_durable")} goes with {auto} (it plans how often a save is durable)'
    elif values["mtbf"] is None:
        return f'{auto} needs {spell("mtbf")} (the mean time between failures: seconds, or "6h")'
    if not memory:
        if values["replicas"] != 1:
            return f'{spell("replicas")} goes with {spell("memory")} (the peers that hold a rank\'s objects in memory)'
        if values["durable_every"] not in (None, 1):
            return (f'{spell("durable_every")} goes with {spell("memory")} (without the memory tier every save is '
                    "durable)")
        if values["mtbf_durable"] is not None:
            return f'{spell("mtbf_durable")} goes with {spell("memory")} and {auto}'
    if values["mtbf_durable"] is not None and values["durable_every"] is not None:
        return f'{spell("mtbf_durable")} plans {spell("durable_every")}; give one of them, not both'
    return None


# ---------------------------------------------------------------------------------------------- alpha-run


def add_flags(parser: argparse.ArgumentParser, names: Iterable[str] | None = None) -> None:
    """One flag per option that has one (``names``: only those). A flag left out is None in the namespace:
    the option's default, not a value given."""
    for option in OPTIONS:
        if option.flag is None or (names is not None and option.name not in names):
            continue
        help_ = option.doc.replace("%", "%%")
        if option.switch:
            parser.add_argument(option.flag, dest=option.name, action="store_const", const=True, default=None,
                                help=help_)
            continue
        choices = getattr(option.check, "choices", None)
        parser.add_argument(option.flag, dest=option.name, default=None, metavar=option.metavar,
                            choices=choices, help=help_ + (f" (default {option.default})" if option.default not in
                                                           (None, (), {}) else ""))


def from_flags(args: argparse.Namespace, names: Iterable[str] | None = None) -> dict[str, Any]:
    """The options alpha-run's flags gave (as text; switches True), parsed and checked by the options'
    rules, spelled as flags: :class:`UsageError`. Returns only the options given."""
    given: dict[str, Any] = {}
    for option in OPTIONS:
        if option.flag is None or (names is not None and option.name not in names):
            continue
        value = getattr(args, option.name, None)
        if value is None:
            continue
        if isinstance(value, str) and option.parse is not None:
            try:
                value = option.parse(value)
            except ValueError as exc:
                text = str(exc)
                raise UsageError(f"{option.flag} {text}" if text.startswith("takes ") else
                                 f"{option.flag} takes {option.metavar or 'a value'}, not {value!r}") from None
            if value is None:
                continue  # --checkpoint-every 0: the script decides
        given[option.name] = value
    check(given, as_flags=True)
    return given


def to_argv(given: Mapping[str, Any]) -> list[str]:
    """``given`` options as alpha-run's flags (the built-in job's command line takes the same flags)."""
    options = by_name()
    argv: list[str] = []
    for name, value in given.items():
        option = options[name]
        if option.flag is None:
            raise ValueError(f"option {name} has no flag")
        argv += [option.flag] if option.switch else [option.flag, str(value)]
    return argv
