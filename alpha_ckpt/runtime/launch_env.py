"""alpha-run's protocol with the processes it starts: environment variables, written and read here only.

alpha-run (:mod:`alpha_ckpt.launch.launcher`) hands every rank of a training script
the store, the run, the resume choice and its checkpoint flags in the
environment (torch's elastic agent copies the launcher's environment into
every worker, restarts included), and names itself so that a worker can bind
its life to it (:mod:`alpha_ckpt.runtime.lifeline`). This module holds the variable
names, :func:`script_environment` (what the launcher writes: the options, alpha_ckpt/runtime/options.py,
as one variable),
:func:`launcher_settings` (what :meth:`Checkpointer.from_launcher_env
<alpha_ckpt.Checkpointer.from_launcher_env>` reads),
:func:`pop_launcher_pid`, the heartbeat's store and period (:func:`heartbeat_environment`,
:func:`pop_heartbeat`, for :mod:`alpha_ckpt.runtime.heartbeat`), the process groups' ``--timeout``
(:func:`process_group_timeout`), and a restart's context: :func:`export_restart`
(the launcher, as its agent restarts the workers) and :func:`restart_context`
(a restarted worker), and the notes a rank leaves in the launch's directory:
:func:`note_checkpoint_call`, :func:`note_peer_failure` and
:func:`record_verdict` (a rank); :func:`own_error` and
:func:`recorded_verdicts` (the launcher).
torch's own ``TORCHELASTIC_RESTART_COUNT`` is read here too
(:func:`restart_attempt`). No other product module reads or writes them.

Only the standard library and :mod:`alpha_ckpt.errors` are imported here:
the launcher checks its flags before torch is imported.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import time
from typing import Any, Iterator, Mapping

from alpha_ckpt.errors import UsageError

# The Checkpointer options alpha-run hands its ranks (its store, the run, the resume choice, and each option
# its flags set, alpha_ckpt/runtime/options.py): one JSON object {option name: value}. With --memory, "memory"
# is the memory tier's directory for this launch, removed at its exit.
OPTIONS = "ALPHA_CKPT_OPTIONS"
IN_PLACE_CONTROL = "ALPHA_CKPT_INPLACE_CONTROL"  # alpha-run --in-place: host:port of the launcher's control store
IN_PLACE_TIMEOUT = "ALPHA_CKPT_INPLACE_TIMEOUT"  # seconds: every wait of a rank for a rendezvous round
TIMEOUT = "ALPHA_CKPT_TIMEOUT"  # alpha-run --timeout, seconds: every process group's timeout in a script's rank
HEARTBEAT = "ALPHA_CKPT_HEARTBEAT"  # host:port of the launcher's store each rank beats to (alpha_ckpt/runtime/heartbeat.py)
HEARTBEAT_PERIOD = "ALPHA_CKPT_HEARTBEAT_PERIOD"  # seconds between a rank's beats
LAUNCHER_PID = "ALPHA_CKPT_LAUNCHER_PID"  # set by alpha-run for every process it starts
# alpha-run's directory of this launch on this node (removed at its exit), where its ranks leave notes for
# it: that a rank reached its first checkpoint call of an attempt (reached/ATTEMPT.RANK, empty), that it
# failed because a peer did (peer/ATTEMPT.RANK), and the verdict it ended with (said/RANK.json), which the
# launcher prints once, naming the ranks.
LAUNCH_DIR = "ALPHA_CKPT_LAUNCH_DIR"
# Set by alpha-run's agent just before it starts the workers of a restart (JSON, see export_restart):
# torch's agent copies the launcher's environment into every worker it starts, so each attempt's
# workers see the value of their own restart and no earlier one.
RESTART = "ALPHA_CKPT_RESTART"
RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"  # torch's: 0 in the first attempt, n in the n-th restart
# torch's switch for its c10d rendezvous: each round (a restart is one) gives the ranks a store of
# their own instead of the agent's, which outlives attempts and still holds the previous attempt's
# gloo addresses (a restarted rank would connect to a dead peer and wait).
SEPARATE_RANK_STORE = ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")


def script_environment(options: Mapping[str, Any], timeout: float) -> dict[str, str]:
    """What alpha-run hands a script's ranks: the Checkpointer ``options`` its flags gave (the store, the run
    and the resume choice among them), as one variable, and the process groups' --timeout."""
    return {OPTIONS: json.dumps(dict(options), sort_keys=True), TIMEOUT: str(timeout)}


@contextlib.contextmanager
def exported(launcher_pid: int, script: Mapping[str, str] | None = None) -> Iterator[None]:
    """The launcher's environment while it starts its workers: its pid, a store of their own for the
    ranks of each rendezvous round (and a script's settings); what was there before is put back after."""
    values = {LAUNCHER_PID: str(launcher_pid), SEPARATE_RANK_STORE[0]: SEPARATE_RANK_STORE[1], **(script or {})}
    before = {name: os.environ.get(name) for name in (*values, RESTART)}
    os.environ.pop(RESTART, None)  # the first attempt is no restart, whatever this process inherited
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def launcher_settings() -> dict[str, Any]:
    """The Checkpointer options alpha-run passed (keyword arguments of
    :class:`~alpha_ckpt.collective.options.CheckpointerOptions`, checked there), a restart's resume choice
    in place of the launch's.

    :class:`UsageError` naming what is missing when this process was not started by alpha-run, or naming
    the variable when its value cannot be read.
    """
    text = os.environ.get(OPTIONS)
    if not text:
        raise UsageError(f"Checkpointer.from_launcher_env: not started by alpha-run ({OPTIONS} unset); pass "
                         "Checkpointer(store, run=...) instead")
    try:
        out = json.loads(text)
    except ValueError:
        out = None
    if not isinstance(out, dict) or not out.get("store") or not out.get("run"):
        raise UsageError(f"{OPTIONS} is not what alpha-run writes (a JSON object with the store and the run)")
    restart = restart_context()
    if restart is not None and restart.resume is not None:
        out["resume"] = restart.resume  # what the launcher chose for this restart (see RestartContext)
    return out


def memory_directory() -> str | None:
    """The memory tier's directory alpha-run made for this launch (``--memory``), or None."""
    try:
        memory = json.loads(os.environ.get(OPTIONS) or "{}").get("memory")
    except (ValueError, AttributeError):
        return None
    return memory if isinstance(memory, str) and memory else None


def run_id() -> str | None:
    """The launch's run id as torch's agent gives it to every worker (torchrun's ``--rdzv-id``, a random one
    with ``--standalone``; alpha-run's launch), or None outside a launcher."""
    return os.environ.get("TORCHELASTIC_RUN_ID") or None


def node_rank() -> str:
    """torch's GROUP_RANK (this node's rank in the rendezvous, as torchrun and alpha-run set it), or ""."""
    return os.environ.get("GROUP_RANK", "")


def torchrun_variable(name: str) -> str | None:
    """A launcher's ``PET_`` variable (torchrun's flags as schedulers set them), or None when unset."""
    if not name.startswith("PET_"):
        raise ValueError(f"{name} is not a torchrun variable")
    return os.environ.get(name)


def ranks_per_node() -> int | None:
    """torch's LOCAL_WORLD_SIZE (ranks on this node), as torchrun and alpha-run set it, or None."""
    value = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(value) if value.isdigit() and int(value) > 0 else None


@dataclasses.dataclass(frozen=True)
class RestartContext:
    """What a restarted worker knows of the restart that started it (:func:`restart_context`).

    ``attempt``: torch's restart count (1 in the first restart). ``detected_at``: the wall-clock
    time (``time.time()``) at which the launcher saw the failure that caused this restart.
    ``failed_rank`` and ``failed_exit``: the global rank that failed first and its exit code (a
    negative one is the signal that killed it), None when not known (a worker stuck in the kernel,
    a node that joined). ``resume``: what this attempt resumes, chosen by the launcher once the
    previous attempt's workers were stopped: "latest", a root digest (``--resume-from ROOT`` whose
    continuation published nothing yet), or None: as the first attempt did (a branch whose new run
    has no generation yet). ``process_started_at``: the wall-clock time at which this worker
    process started (before its interpreter did).
    """

    attempt: int
    detected_at: float
    failed_rank: int | None
    failed_exit: int | None
    resume: str | None
    process_started_at: float

    @property
    def restart_s(self) -> float:
        """Seconds from the detection to this worker's start: stopping the others and the rendezvous."""
        return self.process_started_at - self.detected_at


def restart_attempt() -> int:
    """torch's restart count for this worker (0: the first attempt, or not started by torch's agent)."""
    try:
        return max(0, int(os.environ.get(RESTART_COUNT, "0")))
    except ValueError:
        return 0


def export_restart(*, attempt: int, detected_at: float, failed_rank: int | None, failed_exit: int | None,
                   resume: str | None, started_at: float | None = None) -> None:
    """The launcher, just before its agent starts the workers of restart ``attempt``: what they will read
    with :func:`restart_context` (one JSON value; no pickle). ``started_at``: when this rank began the
    attempt, where that is not its process's start (a rank that rejoins in its process: --in-place)."""
    os.environ[RESTART] = json.dumps({"attempt": attempt, "detected_at": detected_at, "failed_rank": failed_rank,
                                      "failed_exit": failed_exit, "resume": resume, "started_at": started_at})


def restart_context() -> RestartContext | None:
    """This worker's :class:`RestartContext`, or None in the first attempt (or outside alpha-run).

    The launcher's record counts only for the attempt it was written for: a value whose attempt is
    not torch's restart count of this process (one it inherited from elsewhere) is none.
    """
    raw = os.environ.get(RESTART)
    if not raw:
        return None
    try:
        record = json.loads(raw)
        attempt, detected_at = record["attempt"], record["detected_at"]
        failed_rank, failed_exit, resume = record.get("failed_rank"), record.get("failed_exit"), record.get("resume")
    except (ValueError, TypeError, KeyError):
        return None
    if (not isinstance(attempt, int) or isinstance(attempt, bool) or not isinstance(detected_at, (int, float))
            or isinstance(detected_at, bool) or not math.isfinite(detected_at)
            or not all(v is None or (isinstance(v, int) and not isinstance(v, bool)) for v in (failed_rank, failed_exit))
            or not (resume is None or isinstance(resume, str))):
        return None
    if os.environ.get(RESTART_COUNT) is not None and attempt != restart_attempt():
        return None
    started_at = record.get("started_at")
    if not isinstance(started_at, (int, float)) or isinstance(started_at, bool) or not math.isfinite(started_at):
        started_at = process_started_at()
    return RestartContext(attempt=attempt, detected_at=float(detected_at), failed_rank=failed_rank,
                          failed_exit=failed_exit, resume=resume, process_started_at=float(started_at))


def process_started_at() -> float:
    """The wall-clock time at which this process started: its start in the kernel's clock ticks since boot
    (/proc/self/stat) against the time since boot now (/proc/uptime), to about 10 ms; elsewhere, when
    this module was first imported."""
    try:
        with open("/proc/self/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
        with open("/proc/uptime", "rb") as uptime:
            since_boot = float(uptime.read().split()[0])
        now = time.time()
        started_ticks = int(fields[19])  # field 22 of stat(5), counted after the command's ")"
        return now - (since_boot - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return _IMPORTED_AT


_IMPORTED_AT = time.time()


def pop_launcher_pid() -> int | None:
    """The launcher's pid, if alpha-run named itself; the name is taken out of the environment so
    that a process this one starts (not the launcher's child) does not bind to it."""
    named = os.environ.pop(LAUNCHER_PID, None)
    try:
        return None if named is None else int(named)
    except ValueError:
        return None


# Exit statuses, for orchestrators (README): the same from alpha-run, its ranks and the job's owners.
# EXIT_SCRIPT_ERROR: alpha-run's, for a script that failed before any checkpoint call (its own error).
EXIT_OK, EXIT_SCRIPT_ERROR, EXIT_USAGE, EXIT_REFUSED, EXIT_RETRY, EXIT_INTERRUPTED = 0, 1, 2, 3, 75, 130


# ---------------------------------------------------------------- notes a rank leaves for its launcher

_noted: set[tuple[str, str, int]] = set()  # (kind, launch directory, attempt) this process noted


def _rank() -> int | None:
    value = os.environ.get("RANK", "")
    return int(value) if value.isdigit() else None


def _note(kind: str) -> None:
    """An empty file ``KIND/ATTEMPT.RANK`` in the launch's directory, once per attempt; best effort."""
    directory, rank = os.environ.get(LAUNCH_DIR), _rank()
    if not directory or rank is None:
        return
    attempt = restart_attempt()
    if (kind, directory, attempt) in _noted:
        return
    _noted.add((kind, directory, attempt))
    try:
        os.makedirs(os.path.join(directory, kind), exist_ok=True)
        with open(os.path.join(directory, kind, f"{attempt}.{rank}"), "w"):
            pass
    except OSError:
        pass


def noted(directory: str, kind: str, attempt: int, rank: int) -> bool:
    """The launcher: whether ``rank`` left the note ``kind`` ("reached", "peer", "stepped", "prepares") in ``attempt``."""
    return bool(directory) and os.path.exists(os.path.join(directory, kind, f"{attempt}.{rank}"))


def note_checkpoint_call() -> None:
    """This rank reached a checkpoint call (a Checkpointer's save or restore, the one-process API's, a DCP
    door's StorageWriter or StorageReader) in its current attempt: under alpha-run, an empty file
    ``reached/ATTEMPT.RANK`` in the launch's directory, written once per attempt (a rank that recovers in
    place begins a new one). A failure after it is retryable (exit 75); alpha-run answers a rank that exits
    with an error and no such note with exit 1 and no restart (:func:`failed_before_checkpoint`). Elsewhere
    (plain torchrun, one process) it does nothing. Best effort: a note that cannot be written is skipped."""
    _note("reached")


def note_peer_failure() -> None:
    """This rank failed because a peer did (a connection to it broke, a collective with it timed out):
    ``peer/ATTEMPT.RANK``. Such a rank is not the cause of its attempt's failure, checkpoint call or not."""
    _note("peer")


def note_step() -> None:
    """This rank finished a training step in its current attempt (a Checkpointer's ``save`` or ``due``, which
    a training loop calls once a step, ``alpha_ckpt.save``, a DCP ``StorageWriter``): ``stepped/ATTEMPT.RANK``. alpha-run --in-place starts its spares only
    once every rank of the round left it, so that starting them never slows the start or a recovery."""
    _note("stepped")


def note_prepare() -> None:
    """This rank's script hands ``alpha_ckpt.run_resilient`` a ``prepare``: ``prepares/ATTEMPT.RANK``.
    alpha-run --in-place then runs the script in its spares up to there, before they take a rank."""
    _note("prepares")


def failed_before_checkpoint(directory: str, attempt: int, rank: int | None, exitcode: int | None) -> bool:
    """The launcher: whether ``rank``'s exit in ``attempt`` is the script's own error before any checkpoint
    call: an error exit (not a signal; not 2, 3 or 75, which say what they are), with no note of a checkpoint
    call (:func:`note_checkpoint_call`) nor of a peer's failure (:func:`note_peer_failure`). Never without a
    launch directory (``directory`` empty): then nothing was noted."""
    return (bool(directory) and rank is not None and exitcode is not None and exitcode > 0
            and exitcode not in (EXIT_USAGE, EXIT_REFUSED, EXIT_RETRY)
            and not noted(directory, "reached", attempt, rank) and not noted(directory, "peer", attempt, rank))


def own_error(directory: str, attempt: int, failures: list[tuple[int, int]]) -> tuple[int, int] | None:
    """The launcher, on the failures of ``attempt`` (rank, exit code), earliest first: the (rank, code) whose
    failure is the script's own error before any checkpoint call, or None (retryable). A rank killed by a
    signal makes it retryable, except SIGTERM: the agent's own, stopping the others once one failed (torch
    lists those too). A rank that noted a peer's failure is not the cause; of the others the earliest is,
    and it is the script's own error when :func:`failed_before_checkpoint` holds for it."""
    if any(code < 0 and code != -signal.SIGTERM for _, code in failures):
        return None
    for rank, code in failures:
        if code < 0 or code in (EXIT_USAGE, EXIT_REFUSED, EXIT_RETRY) or noted(directory, "peer", attempt, rank):
            continue
        return (rank, code) if failed_before_checkpoint(directory, attempt, rank, code) else None
    return None


def record_verdict(kind: str, text: str) -> bool:
    """A rank ending with a verdict that every rank usually meets alike (``kind`` "refused" or "usage", its
    one-line ``text``): under alpha-run it is left for the launcher, which prints it once naming the ranks
    (True); elsewhere nothing is written (False) and the rank prints it itself. One JSON file per rank,
    written whole (a temporary file renamed); no pickle."""
    directory, rank = os.environ.get(LAUNCH_DIR), _rank()
    if not directory or rank is None:
        return False
    said = os.path.join(directory, "said")
    try:
        os.makedirs(said, exist_ok=True)
        temporary = os.path.join(said, f".{rank}.{os.getpid()}.tmp")
        with open(temporary, "w") as out:
            json.dump({"kind": kind, "text": text}, out)
        os.replace(temporary, os.path.join(said, f"{rank}.json"))
    except OSError:
        return False
    return True


def recorded_verdicts(directory: str) -> list[tuple[str, str, list[int]]]:
    """The launcher: the verdicts its ranks recorded (:func:`record_verdict`), each once: (kind, text, ranks)."""
    said = os.path.join(directory, "said")
    try:
        names = os.listdir(said)
    except OSError:
        return []
    by_verdict: dict[tuple[str, str], list[int]] = {}
    for name in names:
        stem, dot, suffix = name.partition(".")
        if suffix != "json" or not stem.isdigit():
            continue
        try:
            with open(os.path.join(said, name)) as f:
                record = json.load(f)
            key = (str(record["kind"]), str(record["text"]))
        except (OSError, ValueError, TypeError, KeyError):
            continue
        by_verdict.setdefault(key, []).append(int(stem))
    return sorted(((kind, text, sorted(ranks)) for (kind, text), ranks in by_verdict.items()),
                  key=lambda item: item[2][0])


def ranks_text(ranks: list[int]) -> str:
    """Ranks as a person reads them: "rank 3", "ranks 0-3", "ranks 0, 2, 5-7"."""
    parts, run = [], []
    for rank in sorted(set(ranks)):
        if run and rank == run[-1] + 1:
            run.append(rank)
            continue
        if run:
            parts.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
        run = [rank]
    if run:
        parts.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ("ranks " if len(set(ranks)) > 1 else "rank ") + ", ".join(parts)


def describe_exit(code: int) -> str:
    """A worker's exit status as torch reports it: a negative code is the signal that killed it."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def launcher_environment() -> dict[str, str]:
    """The launcher's environment: what alpha-run's own agent hands every rank, before the rank's own variables."""
    return dict(os.environ)


def in_place_settings() -> tuple[str | None, float | None]:
    """alpha-run --in-place: (the control store's host:port, the timeout of every wait), or (None, None)."""
    timeout = os.environ.get(IN_PLACE_TIMEOUT)
    return os.environ.get(IN_PLACE_CONTROL) or None, float(timeout) if timeout else None


def process_group_timeout() -> float | None:
    """alpha-run's --timeout for this rank's process groups, in seconds, or None (not started by alpha-run)."""
    value = os.environ.get(TIMEOUT)
    try:
        seconds = float(value) if value else None
    except ValueError:
        return None
    return seconds if seconds is not None and math.isfinite(seconds) and seconds > 0 else None


def heartbeat_environment(endpoint: str, period: float) -> dict[str, str]:
    """What alpha-run hands every rank so that it beats: the store's ``host:port`` and the period in seconds."""
    return {HEARTBEAT: endpoint, HEARTBEAT_PERIOD: repr(float(period))}


def pop_heartbeat() -> tuple[str | None, float | None]:
    """(the store's host:port, the period) this rank beats with, or (None, None); taken out of the
    environment, as the launcher's pid is: a process this rank starts is no rank of the launcher's."""
    endpoint, period = os.environ.pop(HEARTBEAT, None), os.environ.pop(HEARTBEAT_PERIOD, None)
    try:
        seconds = float(period) if period else None
    except ValueError:
        seconds = None
    if not endpoint or seconds is None or not math.isfinite(seconds) or seconds <= 0:
        return None, None
    return endpoint, seconds


def rank_and_world() -> tuple[int, int]:
    """torchrun's RANK and WORLD_SIZE of this process."""
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def enter_round(port: int, attempt: int) -> None:
    """A rank joining rendezvous round ``attempt`` of alpha-run --in-place: the environment torchrun would give it
    there (the round's MASTER_PORT, TORCHELASTIC_RESTART_COUNT), so what the script reads describes its round."""
    os.environ["MASTER_PORT"], os.environ[RESTART_COUNT] = str(port), str(attempt)


def adopt(environment: Mapping[str, str]) -> None:
    """A warm spare taking the environment of the rank it replaces."""
    os.environ.update(environment)


# alpha-run --in-place: the keys of its control store (alpha_ckpt/launch/inplace.py writes them, ranks read them).
ROUND_KEY = "round"


def round_key(r: int) -> str:
    return f"{ROUND_KEY}/{r}"


def joined_key(r: int, rank: int) -> str:
    return f"joined/{r}/{rank}"


def spare_key(number: int) -> str:
    return f"spare/{number}"


def heartbeat_key(pid: int) -> str:
    """The counter the process ``pid`` adds one to at every beat, in its launcher's store."""
    return f"beat/{pid}"
