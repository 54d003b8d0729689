"""alpha-run: start a training script's ranks like torchrun does, on torch's own elastic launcher.

    alpha-run --nproc 2 --store S [--run R] [--resume latest | --resume-from D] train.py --its --own --args
    alpha-run --nproc 4 --store S -m alpha_ckpt.job configs/forecast.toml --updates 5
    alpha-run --nproc 4 --store S --resume-from ROOT_DIGEST -m alpha_ckpt.job configs/forecast.toml --updates 5
    alpha-run --nnodes 2 --node-rank 0 --nproc 2 --rdzv-endpoint HOST:PORT ... -m alpha_ckpt.job ...

A training script runs on every rank as ``python train.py ARGS`` would under
torchrun; its Checkpointer finds the store, the run (default: the script's
name), the resume choice and the checkpoint flags with
``Checkpointer.from_launcher_env()`` (alpha_ckpt/runtime/launch_env.py). A Refusal
escaping the script exits 3.

torchrun's launcher flags are accepted, each also from its PET_ variable as
torchrun reads them (a flag on the command line wins), and handed to
torch.distributed.run, which sets the same worker environment (RANK,
WORLD_SIZE, LOCAL_RANK, GROUP_RANK, MASTER_ADDR, ...) and does the rendezvous
(docs/MANY_NODES.md). Each rank runs the
script (or module: the built-in job is ``-m alpha_ckpt.job``) under
:mod:`alpha_ckpt.launch.script_runner`.

Every flag, the run name and the store's writability are checked here, in
one process, before any rank starts: a usage error is one line on stderr and
exit 2 (a script's own arguments are the script's to check). The owners die with this process, however it dies
(see alpha_ckpt/runtime/lifeline.py).

Exit codes: 0 done, 1 a script's own error before any checkpoint call (not
restarted), 3 checkpoint refused, 75 retryable failure (an owner died, a
publish failed, a script failed after a checkpoint call), 2 usage error, 130
interrupted. A refusal or usage error the ranks meet is printed once, naming
the ranks (they leave it in this launch's directory, launch_env.LAUNCH_DIR).

With ``--max-restarts N`` torch's elastic agent restarts every rank when one
fails, through :func:`restarting_agent`: a worker that exits 3 (refused) or 2
(usage) ends the restarts at once (the next attempt would be told the same),
and each restart's workers learn what failed, when it was seen and what they
resume (:func:`alpha_ckpt.runtime.launch_env.restart_context`): the newest generation
(:func:`restart_resume`).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import time
from typing import Any, Callable, Iterator

from alpha_ckpt.format.records import NAME_RE
from alpha_ckpt.runtime import heartbeat, launch_env
from alpha_ckpt.runtime.orphans import remove_orphaned
from alpha_ckpt.store.location import canonical
from alpha_ckpt.runtime import options as options_core
from alpha_ckpt.runtime.heartbeat import check_heartbeat_args
from alpha_ckpt.launch.inplace import check_in_place_args, run_in_place
from alpha_ckpt.launch.usage import OneLineArgumentParser, UsageError, check_checkpoint_flags, check_store_writable

from alpha_ckpt.runtime.launch_env import (EXIT_INTERRUPTED, EXIT_OK, EXIT_REFUSED, EXIT_RETRY, EXIT_SCRIPT_ERROR,  # noqa: F401
                         EXIT_USAGE, describe_exit)

# torchrun's launcher flags, handed to torch.distributed.run: (flag, torchrun's default, argparse kwargs).
# Each takes its default from PET_<FLAG> (``--rdzv-conf``: PET_RDZV_CONF) as torchrun's do, so a launch that a
# scheduler describes only by environment (Kubeflow's PyTorchJob and Trainer v2, TorchX) runs as it would
# under torchrun; a flag on the command line wins over its variable.
_TORCHRUN_FLAGS = (
    ("--nnodes", "1", {}),
    ("--node-rank", 0, {"type": int}),
    ("--master-addr", None, {}),
    ("--master-port", None, {"type": int}),
    ("--rdzv-endpoint", None, {}),
    ("--rdzv-backend", None, {}),
    ("--rdzv-id", None, {}),
    ("--rdzv-conf", None, {"metavar": "KEY=VALUE,...", "help": "the rendezvous's settings, as torchrun's: "
                                "is_host, join_timeout, last_call_timeout, read_timeout, close_timeout"}),
    ("--local-addr", None, {"help": "this node's address as the other nodes reach it (default: its host name)"}),
    ("--local-ranks-filter", None, {"metavar": "R,R,...", "help": "show only these local ranks' output "
                                        "on the console (torchrun's; e.g. 0)"}),
    ("--max-restarts", 0, {"type": int}),
)
# torchrun's names for the values of --nproc-per-node that are no number (resolved by torch on this host).
NPROC_WORDS = ("auto", "cpu", "gpu", "xpu")
# PET_ variables torchrun reads for flags that alpha-run has no use for and that would change what it starts.
_PET_REFUSED = ("PET_NO_PYTHON", "PET_RUN_PATH")


def pet_variable(flag: str) -> str:
    """The environment variable torchrun reads for ``flag`` (``--rdzv-conf``: ``PET_RDZV_CONF``)."""
    return "PET_" + flag.lstrip("-").replace("-", "_").upper()


@dataclasses.dataclass(frozen=True)
class BadVariable:
    """A PET_ variable whose value its flag would refuse: the flag's value until :func:`check_variables`
    names it (argparse would name the flag, which the command line does not hold)."""
    name: str
    value: str


def _from_environment(flag: str, default, convert=None):
    """``flag``'s default as torchrun takes it: its PET_ variable when set (converted as the flag's value is),
    else ``default``."""
    name = pet_variable(flag)
    value = launch_env.torchrun_variable(name)
    if value is None:
        return default
    try:
        return value if convert is None else convert(value)
    except (ValueError, argparse.ArgumentTypeError):
        return BadVariable(name, value)


def check_variables(args) -> None:
    """:class:`UsageError` naming the first PET_ variable that gave a flag a value it does not take."""
    for value in vars(args).values():
        if isinstance(value, BadVariable):
            raise UsageError(f"{value.name}={value.value!r} is not a value its flag takes")


def _nproc(value: str):
    if value in NPROC_WORDS:
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is neither a number nor one of {', '.join(NPROC_WORDS)}") from None


def parser() -> OneLineArgumentParser:
    # No abbreviations: argparse reads them anywhere, even among the script's own arguments after
    # its path, and a script's option that prefixes one of ours (--st of --store) would be refused.
    p = OneLineArgumentParser(prog="alpha-run", description="Launch a training script's ranks (torchrun-compatible).",
                              allow_abbrev=False)
    p.add_argument("config", metavar="TARGET", help="a training script (train.py; its own arguments follow it) or "
                   "-m MODULE (python -m), e.g. -m alpha_ckpt.job configs/forecast.toml --updates 5")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    p.add_argument("-m", dest="module", action="store_true", help="TARGET is a module (python -m), as torchrun -m")
    p.add_argument("--nproc-per-node", "--nproc_per_node", "--nproc", dest="nproc", type=_nproc,
                   default=_from_environment("--nproc-per-node", 1, _nproc),
                   help="ranks on this node: a number, or auto, cpu, gpu as torchrun's (default 1)")
    for flag, default, kwargs in _TORCHRUN_FLAGS:
        p.add_argument(flag, flag.replace("-", "_").replace("__", "--", 1),
                       default=_from_environment(flag, default, kwargs.get("type")), **kwargs)
    p.add_argument("--standalone", action="store_true", default=_from_environment("--standalone", False, lambda v: bool(int(v))))
    p.add_argument("--store", default="./alpha-store", help="store directory (default ./alpha-store)")
    p.add_argument("--run", help="the script's run name (default: its file or module name)")
    resume = p.add_mutually_exclusive_group()
    resume.add_argument("--resume-from", metavar="ROOT_DIGEST", help="continue exactly this generation or refuse")
    resume.add_argument("--resume", choices=["latest"], help="continue the newest complete generation (the default)")
    # The Checkpointer's options, each spelled once (alpha_ckpt/runtime/options.py): --publisher, --save,
    # --checkpoint-every, --memory, ...
    options_core.add_flags(p)
    p.add_argument("--timeout", type=float, default=120.0,
                   help="seconds every collective of a rank's process groups may wait (default 120)")
    p.add_argument("--heartbeat-limit", type=float, metavar="SECONDS",
                   help="a rank whose heartbeat is silent this long is hung: killed and handled as a failed rank "
                        "(default: half of --timeout; below --timeout)")
    p.add_argument("--heartbeat-period", type=float, metavar="SECONDS",
                   help="seconds between a rank's heartbeats (default 1, or a quarter of --heartbeat-limit)")
    p.add_argument("--in-place", action="store_true", help="with --max-restarts on one node: replace only a failed "
                   "rank; the others recover in their processes (the script calls alpha_ckpt.run_resilient)")
    p.add_argument("--spares", type=int, metavar="K",
                   help="with --in-place: K processes that wait with torch imported and take a failed rank's "
                        "number at once; refilled after every rank's first step of a new round (default 1)")
    return p


def torchrun_argv(args) -> list[str]:
    """torchrun's launcher flags for ``args``."""
    # Every flag explicitly, the defaults included: torch's parser would otherwise take a PET_ variable's value.
    out = ["--nproc-per-node", str(args.nproc)]
    for flag, _, _ in _TORCHRUN_FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            out += [flag, str(value)]
    if args.standalone or restarts_on_one_node(args):
        out.append("--standalone")
    return out


def torchrun_args(argv: list[str]):
    """torchrun's namespace for ``argv`` (launcher flags, ``-m MODULE``, then the program's arguments).

    Only the launcher's part goes through torchrun's parser: argparse classifies every
    argument before it knows where the program's begin, so a program option that is a
    prefix of one of torchrun's (``--run`` of ``--run-path``) would be refused or taken.
    """
    from torch.distributed.run import get_args_parser
    at = argv.index("-m") + 2
    namespace = get_args_parser().parse_args(argv[:at])
    namespace.training_script_args = argv[at:]
    return namespace


def check_launch_args(args) -> None:
    """torchrun's own flags, by torch's own parsers; :class:`UsageError` for the first bad one."""
    from torch.distributed.elastic.rendezvous import registry
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
    from torch.distributed.run import determine_local_world_size, parse_min_max_nnodes
    for name in _PET_REFUSED:
        if (launch_env.torchrun_variable(name) or "0") != "0":
            raise UsageError(f"{name} is set: alpha-run starts its ranks in Python, unset it")
    if isinstance(args.nproc, str):  # auto, cpu, gpu: this host's count, as torchrun resolves it
        try:
            args.nproc = determine_local_world_size(args.nproc)
        except ValueError as exc:
            raise UsageError(f"--nproc-per-node {args.nproc}: {exc}") from None
    if args.nproc < 1:
        raise UsageError(f"--nproc-per-node must be at least 1, not {args.nproc}")
    try:
        min_nodes, max_nodes = parse_min_max_nnodes(args.nnodes)
    except (ValueError, RuntimeError):
        raise UsageError(f"--nnodes takes N or MIN:MAX, not {args.nnodes!r}") from None
    if not 0 < min_nodes <= max_nodes:
        raise UsageError(f"--nnodes {args.nnodes}: need 0 < MIN <= MAX")
    if not 0 <= args.node_rank < max_nodes:
        raise UsageError(f"--node-rank must be in [0, {max_nodes}), not {args.node_rank}")
    if args.max_restarts < 0:
        raise UsageError(f"--max-restarts must not be negative, not {args.max_restarts}")
    if args.max_restarts > 0 and static_rendezvous(args):
        # The static rendezvous keeps one store for every attempt: a restarted rank can read the
        # previous attempt's addresses there and wait on a dead peer (gloo) until the timeout.
        raise UsageError("--max-restarts needs torch's c10d rendezvous, not the static one (--master-addr/"
                         "--master-port): on one node drop those flags; on several pass --rdzv-backend c10d "
                         "--rdzv-endpoint HOST:PORT")
    if args.master_port is not None and not 0 < args.master_port < 65536:
        raise UsageError(f"--master-port must be in [1, 65535], not {args.master_port}")
    if (args.master_port is not None and args.node_rank == 0 and not args.standalone
            and args.rdzv_endpoint is None and args.rdzv_backend in (None, "static") and port_taken(args.master_port)):
        raise UsageError(f"--master-port {args.master_port} is taken on this host (another job's rendezvous?)")
    if args.rdzv_endpoint is not None:
        try:
            parse_rendezvous_endpoint(args.rdzv_endpoint, default_port=29400)
        except ValueError as exc:
            raise UsageError(f"--rdzv-endpoint {args.rdzv_endpoint!r}: {exc}") from None
    known = getattr(registry.handler_registry, "_registry", None)  # torch's and plugins' backends
    if args.rdzv_backend is not None and known is not None and args.rdzv_backend not in known:
        raise UsageError(f"--rdzv-backend must be one of {', '.join(sorted(known))}, not {args.rdzv_backend!r}")
    check_rdzv_conf(args.rdzv_conf, min_nodes, max_nodes)
    if args.local_ranks_filter:
        try:
            shown = {int(rank) for rank in args.local_ranks_filter.split(",")}
        except ValueError:
            shown = {-1}
        if not all(0 <= rank < args.nproc for rank in shown):
            raise UsageError(f"--local-ranks-filter takes local ranks in [0, {args.nproc}) separated by commas, "
                             f"not {args.local_ranks_filter!r}")


# The settings of --rdzv-conf whose values torch reads as a boolean or as seconds; a bad one would
# otherwise surface as a traceback from inside the rendezvous, after the node waited for the others.
_RDZV_BOOLEANS = ("is_host",)
_RDZV_SECONDS = ("join_timeout", "last_call_timeout", "read_timeout", "close_timeout", "timeout",
                 "keep_alive_interval", "heartbeat_timeout")


def check_rdzv_conf(text: str | None, min_nodes: int, max_nodes: int) -> None:
    """--rdzv-conf KEY=VALUE,... read by torch's own parser and accessors; :class:`UsageError` for a bad one."""
    if not text:
        return
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.run import _parse_rendezvous_config
    try:
        conf = _parse_rendezvous_config(text)
    except ValueError as exc:
        raise UsageError(f"--rdzv-conf {text!r}: {exc}") from None
    params = RendezvousParameters("c10d", "", "check", min_nodes, max_nodes, **conf)
    for key in conf:
        try:
            if key in _RDZV_BOOLEANS:
                params.get_as_bool(key)
            elif key in _RDZV_SECONDS:
                value = params.get_as_int(key)
                if value is not None and value <= 0:
                    raise ValueError("not positive")
        except ValueError:
            kind = "true or false (1 or 0)" if key in _RDZV_BOOLEANS else "a whole number of seconds above 0"
            raise UsageError(f"--rdzv-conf {key}={conf[key]}: {key} takes {kind}") from None


def static_rendezvous(args) -> bool:
    """torchrun's static rendezvous: --master-addr/--master-port, or --rdzv-backend static."""
    return (not args.standalone and args.rdzv_endpoint is None and args.rdzv_backend in (None, "static")
            and (args.master_addr is not None or args.master_port is not None or args.rdzv_backend == "static"
                 or not one_node(args)))


def one_node(args) -> bool:
    """Whether --nnodes names one node: 1, or torchrun's own default 1:1."""
    return args.nnodes in ("1", "1:1")


def restarts_on_one_node(args) -> bool:
    """--max-restarts on one node with no rendezvous named: torch's c10d rendezvous on a free local port
    (torchrun --standalone), whose every restart is a new round with a new store for the ranks."""
    return (args.max_restarts > 0 and one_node(args) and not args.standalone and args.rdzv_endpoint is None
            and args.rdzv_backend is None and args.master_addr is None and args.master_port is None)


def port_taken(port: int) -> bool:
    """Whether a listening socket holds ``port`` here, where node 0's rendezvous server will listen."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server does: TIME_WAIT is no owner
        try:
            probe.bind(("", port))
        except OSError:
            return True
    return False


def script_argv(args) -> list[str]:
    """torchrun's arguments that start ``python -m alpha_ckpt.launch.script_runner`` per rank."""
    target = ["-m", args.config] if args.module else [os.path.abspath(args.config)]
    return torchrun_argv(args) + ["-m", "alpha_ckpt.launch.script_runner", *target, *args.script_args]


def script_options(args) -> dict[str, Any]:
    """The Checkpointer options a script's ranks get: the store, the run, the resume choice when a flag gave one
    (none: "latest", the option's default, as under torchrun) and every option a flag gave (with --memory,
    the tier's directory this launch made)."""
    options = {"store": canonical(args.store), "run": script_run(args), **options_core.from_flags(args)}
    if args.resume_from or args.resume:
        options["resume"] = args.resume_from or args.resume
    if options.get("memory"):
        options["memory"] = args.memory_dir
    return options


def script_environment(args) -> dict[str, str]:
    """What a script's ``Checkpointer.from_launcher_env()`` reads (alpha_ckpt/runtime/launch_env.py)."""
    return launch_env.script_environment(script_options(args), args.timeout)


def script_run(args) -> str:
    """The script's run: --run, else its name as a run name can be (``_train_v2.py``: ``train-v2``)."""
    if args.run:
        return args.run
    stem = os.path.splitext(os.path.basename(args.config.rstrip("/")))[0]
    return re.sub(r"[^A-Za-z0-9.-]", "-", stem).strip("-.")[:128]


def check_script_args(args) -> None:
    check_checkpoint_flags(args)
    run = script_run(args)
    if not NAME_RE.match(run):
        raise UsageError(f"--run {args.run!r} is not a plain name ([A-Za-z0-9._-], 1-128 chars, starting with a "
                         f"letter or digit)" if args.run else
                         f"no run name can be made of {args.config!r}: pass --run NAME")
    if args.module:
        from alpha_ckpt.launch.script_runner import module_problem
        problem = module_problem(args.config)
        if problem:
            raise UsageError(problem)
        return
    if not os.path.isfile(args.config):
        raise UsageError(f"script {args.config}: no such file")


def parse(argv: list[str]):
    """alpha-run's arguments; a script's own arguments follow its path (or module)."""
    return parser().parse_args(argv)


def main(argv=None) -> int:
    args = parse(list(sys.argv[1:] if argv is None else argv))
    try:
        # The script's checks first: they need no torch, so a typo there answers at once; torchrun's
        # flags are checked by torch's parsers (seconds to import) next.
        check_variables(args)
        check_script_args(args)
        check_in_place_args(args)
        check_heartbeat_args(args)
        check_launch_args(args)
        check_store_writable(args.store)
    except UsageError as exc:
        print(f"alpha-run: {exc}", file=sys.stderr)
        return EXIT_USAGE
    from torch.distributed import DistNetworkError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run
    # Each owner binds its life to this process (alpha_ckpt/runtime/lifeline.py); torch copies
    # this environment into every owner it starts, restarts included.
    if args.memory:  # the memory tier's holders: in host memory, for as long as this launch lives
        parent = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        remove_orphaned_tiers(parent)
        args.memory_dir = tempfile.mkdtemp(prefix=f"{MEMORY_PREFIX}{os.getpid()}-", dir=parent)
    outcome = Outcome()
    # Where the ranks leave notes for this process (launch_env.LAUNCH_DIR), for as long as this launch lives.
    remove_orphaned_tiers(tempfile.gettempdir(), LAUNCH_PREFIX)
    args.launch_dir = tempfile.mkdtemp(prefix=f"{LAUNCH_PREFIX}{os.getpid()}-")
    notes = {launch_env.LAUNCH_DIR: args.launch_dir}
    own_errors: list[Failure] = []  # a script's rank that failed before any checkpoint call (no restart)

    def ends_restarts(attempt: int, failures: dict) -> bool:
        in_order = sorted(failures.items(), key=lambda item: (item[1].timestamp, item[0]))
        found = launch_env.own_error(
            args.launch_dir, attempt, [(rank, failure.exitcode) for rank, failure in in_order])
        if found is not None:
            own_errors.append(Failure(time.time(), *found))
        return found is not None
    try:
        if args.in_place:  # this launcher's own agent (alpha_ckpt/launch/inplace.py), not torch's
            with launch_env.exported(os.getpid(), {**script_environment(args), **notes}):
                return run_in_place(args)
        # The store this node's ranks beat to, for as long as the launch lives (alpha_ckpt/runtime/heartbeat.py).
        beats, endpoint = heartbeat.serve(BEAT_HOST)
        watcher = heartbeat.Watcher(beats, args.heartbeat_limit, startup=args.timeout)
        ranks = script_environment(args)
        with launch_env.exported(os.getpid(), {**ranks, **notes, **launch_env.heartbeat_environment(
                    endpoint, args.heartbeat_period)}), \
                restarting_agent(lambda attempt, failure: on_restart(args, attempt, failure),
                                 watcher, outcome, ends_restarts):
            run(torchrun_args(script_argv(args)))
    except ChildFailedError as exc:
        codes = {failure.exitcode for failure in exc.failures.values()}
        # A refusal is a collective verdict: every owner exits 3, and the agent may
        # stop the slower ones with a signal first. Any other failure is retryable.
        if EXIT_REFUSED in codes:
            return EXIT_REFUSED
        # A usage error (a script's argparse) stops the first rank; the agent then
        # signals the rest, so only the first failure tells the cause.
        first = outcome.failure or first_failure(exc.failures, time.time())
        if EXIT_USAGE in codes and first.exitcode == EXIT_USAGE:
            return EXIT_USAGE
        if own_errors:
            print(own_error_line(own_errors[-1]), file=sys.stderr)
            return EXIT_SCRIPT_ERROR
        print(f"alpha-run: rank {first.rank} {first.describe()}"
              + (f"; no restart left of --max-restarts {args.max_restarts}" if args.max_restarts else "")
              + "; retry with --resume latest", file=sys.stderr)
        return EXIT_RETRY
    except DistNetworkError as exc:
        if "EADDRINUSE" not in str(exc):
            raise
        # The port was free when checked and taken before the rendezvous server listened on it.
        print(f"alpha-run: --master-port {args.master_port}: address already in use", file=sys.stderr)
        return EXIT_USAGE
    except SignalException:
        return EXIT_INTERRUPTED
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    finally:
        say_verdicts(args.launch_dir)
        shutil.rmtree(args.launch_dir, ignore_errors=True)
        if args.memory:
            shutil.rmtree(args.memory_dir, ignore_errors=True)
    return EXIT_OK


BEAT_HOST = "127.0.0.1"  # each node's ranks beat to their own launcher, on their host


def own_error_line(failure: Failure) -> str:
    """The line of a script whose rank failed before any checkpoint call (its traceback is above it)."""
    return (f"alpha-run: rank {failure.rank} failed ({describe_exit(failure.exitcode)}) before any checkpoint call: "
            "the script's own error (above), which a restart would meet again; not restarted")


def say_verdicts(directory: str) -> None:
    """Each verdict the ranks recorded (a refusal, a usage error), once, naming the ranks that met it."""
    for kind, text, ranks in launch_env.recorded_verdicts(directory):
        what = "checkpoint refused" if kind == "refused" else "usage error"
        print(f"alpha-run: {what} on {launch_env.ranks_text(ranks)}: {text}", file=sys.stderr)


MEMORY_PREFIX = "alpha-ckpt-memory-"  # + the launcher's pid: a tier whose launcher is gone is removed
LAUNCH_PREFIX = "alpha-run-"  # + the launcher's pid: the notes of a launch whose launcher is gone are removed


def remove_orphaned_tiers(parent: str, prefix: str = MEMORY_PREFIX) -> None:
    """Remove the directories (``prefix`` + a launcher's pid) of launchers that died without removing theirs
    (SIGKILL): the memory tiers (host memory), the launches' notes."""
    remove_orphaned(parent, prefix)


KILLED_GONE_S = 10.0  # how long the agent waits to see a killed hung worker gone (SIGKILL: at once)

# Worker exits that a restart would only repeat: a refusal (the same store gives the same verdict)
# and a usage error. The agent stops at the first attempt that has one.
VERDICTS = frozenset({EXIT_REFUSED, EXIT_USAGE})


@dataclasses.dataclass(frozen=True)
class Failure:
    """What the agent saw fail: when (``time.time()``), the global rank that failed first and its exit
    code (negative: the signal), both None when unknown (a worker stuck in the kernel, a node joining);
    ``hung``: the rank was killed for its silent heartbeat (:class:`alpha_ckpt.runtime.heartbeat.Hung`)."""
    detected_at: float
    rank: int | None = None
    exitcode: int | None = None
    hung: heartbeat.Hung | None = None

    def describe(self) -> str:
        """What happened to the rank, for a message: "failed (exit code 1)", "hung: no heartbeat for 5.0 s, killed"."""
        if self.hung is not None:
            return self.hung.describe()
        return "failed" + (f" ({describe_exit(self.exitcode)})" if self.exitcode is not None else "")


@dataclasses.dataclass
class Outcome:
    """What :func:`restarting_agent` learned of the current attempt that torch's result does not say: the
    rank it killed as hung (None: none)."""
    failure: Failure | None = None


def first_failure(failures: dict, detected_at: float) -> Failure:
    """The failure that most likely caused the others, of ``failures`` (global rank -> torch's
    ProcessFailure): the earliest (torch stamps whole seconds), and among those a worker killed by a
    signal before one that exited (a peer that saw the connection drop exits a moment later, often
    in the same second), SIGTERM last (the agent's own, stopping the rest), then the lowest rank."""
    if not failures:
        return Failure(detected_at)

    def cause(item):
        rank, failure = item
        code = failure.exitcode
        return failure.timestamp, 2 if code == -signal.SIGTERM else 0 if code < 0 else 1, rank
    rank, failure = min(failures.items(), key=cause)
    return Failure(detected_at, rank, failure.exitcode)


@contextlib.contextmanager
def restarting_agent(on_restart: Callable[[int, Failure], None], watcher: heartbeat.Watcher | None = None,
                     outcome: Outcome | None = None,
                     ends_restarts: Callable[[int, dict], bool] | None = None) -> Iterator[None]:
    """torch's elastic agent, for the block, as alpha-run runs it: a worker exit in :data:`VERDICTS`
    ends the restarts, and so do the failures of attempt ``a`` (global rank -> torch's ProcessFailure)
    for which ``ends_restarts(a, failures)`` holds (a script's own error before any checkpoint call,
    :func:`alpha_ckpt.runtime.launch_env.own_error`); ``on_restart(attempt, failure)`` runs before the workers
    of each restart start (the previous attempt's all stopped, the rendezvous done), and with
    ``watcher`` a worker whose heartbeat is silent past its limit is killed and is the attempt's
    failure (kept in ``outcome`` too, for the message when no restart is left).

    torch's launcher builds its agent inside ``launch_agent`` and offers no other way to give it
    another class; the class it names is replaced for the block and put back after.
    """
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.launcher import api as launcher_api
    base = launcher_api.LocalElasticAgent
    seen = Outcome() if outcome is None else outcome

    class RestartingAgent(base):
        _failure: Failure | None = None
        _restarting = False

        def _monitor_workers(self, worker_group):
            result = super()._monitor_workers(worker_group)
            if result.state == WorkerState.HEALTHY and watcher is not None:
                hung = watcher.hung({rank: proc.pid for rank, proc in self._running(worker_group).items()})
                if hung:
                    result = self._kill_hung(worker_group, hung)
            if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
                self._failure = seen.failure or first_failure(result.failures, time.time())
                attempt = worker_group.spec.max_restarts - self._remaining_restarts
                if any(failure.exitcode in VERDICTS for failure in result.failures.values()) or (
                        ends_restarts is not None and ends_restarts(attempt, result.failures)):
                    # torch's own way to end restarts (its check of workers stuck in the kernel does so too):
                    # with none left, its loop stops the workers and returns the failure.
                    self._remaining_restarts = 0
            return result

        def _running(self, worker_group) -> dict:
            """Global rank -> the process (Popen) of each worker still running: one that ended is not watched,
            and its pid, once reaped, may be another process's."""
            handlers = getattr(self._pcontext, "subprocess_handlers", None) or {}  # torch's, for a command
            return {worker_group.workers[local_rank].global_rank: handler.proc
                    for local_rank, handler in handlers.items() if handler.proc.poll() is None}

        def _kill_hung(self, worker_group, hung: list):
            """Kill the hung workers (the first is the attempt's failure) and return torch's result once it
            sees them gone, so that nothing starts in their place before."""
            detected_at = time.time()
            running = self._running(worker_group)
            for each in hung:
                if each.rank in running and running[each.rank].pid == each.pid:  # not reaped: the pid is its own
                    heartbeat.kill(each.pid)
            seen.failure = Failure(detected_at, hung[0].rank, -signal.SIGKILL, hung=hung[0])
            deadline = time.monotonic() + KILLED_GONE_S
            while True:
                result = super()._monitor_workers(worker_group)
                if result.state != WorkerState.HEALTHY or time.monotonic() > deadline:
                    return result
                time.sleep(0.01)

        def _restart_workers(self, worker_group):
            # After a failure, or when another node joins or leaves (then no rank of ours failed).
            if self._failure is None:
                self._failure = Failure(time.time())
            self._restarting = True
            super()._restart_workers(worker_group)

        def _start_workers(self, worker_group):
            if self._restarting:
                attempt = worker_group.spec.max_restarts - self._remaining_restarts
                on_restart(attempt, self._failure)
                self._failure, self._restarting = None, False
            seen.failure = None  # a new attempt: no rank of it was found hung yet
            return super()._start_workers(worker_group)

    launcher_api.LocalElasticAgent = RestartingAgent
    try:
        yield
    finally:
        launcher_api.LocalElasticAgent = base


def on_restart(args, attempt: int, failure: Failure) -> None:
    """Tell the workers of restart ``attempt`` what failed and what they resume, and say it on stderr."""
    resume = restart_resume(args.store, resume_from=args.resume_from)
    launch_env.export_restart(attempt=attempt, detected_at=failure.detected_at, failed_rank=failure.rank,
                              failed_exit=failure.exitcode, resume=resume)
    cause = ("another node joined or left" if failure.rank is None and failure.exitcode is None else
             f"rank {failure.rank if failure.rank is not None else '?'} {failure.describe()}")
    what = {"latest": "resumes the newest generation"}
    # The restarts that run out end with the one line that starts "alpha-run: rank R failed".
    print(f"alpha-run: restart {attempt} of {args.max_restarts} after {cause}: it "
          f"{what.get(resume, f'resumes {str(resume)[:16]}...')}", file=sys.stderr, flush=True)


def resume_after_restart(resume_from: str | None, *, root_epoch: int | None, newest_epoch: int | None) -> str:
    """What a restart resumes (pure): the newest generation, except after ``--resume-from ROOT`` while the
    run has no continuation of ROOT yet (no generation of an epoch newer than ROOT's, ``root_epoch``):
    then ROOT again. The newest generation would then be one ROOT was chosen over, and once a
    continuation published, ROOT is stale: going back to it would lose what the restarts trained.
    An unknown epoch (ROOT not found) keeps ROOT, which its restore refuses as it did the first time."""
    if resume_from is None:
        return "latest"
    if root_epoch is None or newest_epoch is None or newest_epoch <= root_epoch:
        return resume_from
    return "latest"


def restart_resume(store_root: str, *, resume_from: str | None) -> str:
    """What the workers of a restart resume, read from the store once the previous attempt stopped:
    "latest", or the root digest of --resume-from while nothing continued it (:func:`resume_after_restart`)."""
    if resume_from is None:
        return "latest"
    from alpha_ckpt.errors import Refusal
    from alpha_ckpt.store import Store
    try:
        with Store(store_root) as store:
            record = store.find_ref(resume_from)
            newest = None if record is None else max(
                (r.prefix.epoch for r in store.history(record.run, record.step).records), default=None)
    except (OSError, Refusal, ValueError):
        # The store cannot be read now: the first attempt's choice, which its restore checks again.
        return resume_from
    return resume_after_restart(resume_from, root_epoch=None if record is None else record.prefix.epoch,
                                newest_epoch=newest)


def entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry()
