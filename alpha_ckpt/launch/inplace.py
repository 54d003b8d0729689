"""alpha-run --in-place: restarts that replace the failed rank only; the survivors keep their processes.

torch's elastic agent answers a failed rank by stopping every rank and starting
the whole world again (python, import torch, the model, the rendezvous). This
agent, on one node, starts the ``nproc`` ranks of a training script as
alpha-run's script runner does (``python -m alpha_ckpt.launch.script_runner SCRIPT
ARGS``, bound to the launcher by :mod:`alpha_ckpt.runtime.lifeline`, with the
environment torchrun gives a worker), and watches them:

- a rank that exits with a failure while restarts remain begins rendezvous
  round ``r + 1``: a fresh rendezvous store (a ``torch.distributed.TCPStore``
  on a free port, so no rank can read a previous round's gloo addresses), the
  round announced in the control store, and ONE replacement process with the
  failed rank's number: a waiting spare (:func:`spare_main`; ``--spares K``,
  default 1, started once every rank finished a step of the round: torch
  imported, and the script's ``run_resilient`` ``prepare`` run where the ranks
  pass one) when there is one, else a new process. The survivors learn of it through the control store
  (:mod:`alpha_ckpt.launch.resilient`, ``alpha_ckpt.run_resilient``), leave their
  broken process groups and join the new round in the same process.
- a rank of an earlier round that fails before it joined the current one fell
  with the failure that began the round (a script that does not call
  ``run_resilient`` dies with its peer): it is replaced in the same round, and
  no restart is counted for it.
- exit 3 (a refusal) or 2 (a usage error) stops every rank and is the exit
  status: a restart would meet the same verdict. So does a rank's error before
  any checkpoint call of its round (the script's own), with exit 1.
- restarts run out: every rank is stopped, one line names the failed rank, exit 75.
- every rank exits 0: exit 0.
- a rank whose heartbeat (:mod:`alpha_ckpt.runtime.heartbeat`, ``beat/PID`` in the
  control store) is silent past ``--heartbeat-limit`` is hung: it is SIGKILLed,
  and once it is gone it is handled as a rank that exited with a failure (the
  rank named in the round and its messages).

The control store (``launch_env.IN_PLACE_CONTROL``, ``host:port``) holds ``round``
(the newest round), ``round/R`` (its JSON: the rendezvous port, the failed rank
and its exit status) and ``joined/R/RANK`` (written by a rank once it joined
round R's group). Every wait of a rank on it is bounded by ``--timeout``
(``launch_env.IN_PLACE_TIMEOUT``).

The checks of the flags (:func:`check_in_place_args`) import no torch.
"""
from __future__ import annotations

import enum
import json
import os
import signal
import sys
import time
import uuid
from dataclasses import dataclass, field

from alpha_ckpt.runtime import heartbeat, launch_env
from alpha_ckpt.errors import UsageError
from alpha_ckpt.runtime.launch_env import (EXIT_INTERRUPTED, EXIT_OK, EXIT_REFUSED, EXIT_RETRY, EXIT_SCRIPT_ERROR, EXIT_USAGE,
                         IN_PLACE_CONTROL as CONTROL, IN_PLACE_TIMEOUT as TIMEOUT, ROUND_KEY, describe_exit,
                         joined_key, round_key, spare_key)

HOST = "127.0.0.1"  # one node: every store listens on the loopback interface
POLL_S = 0.02  # how often the agent looks at its ranks: a death is seen within this
STOP_GRACE_S = 5.0  # SIGTERM, then SIGKILL after this
KILLED_GONE_S = 10.0  # how long the agent waits for a hung rank it SIGKILLed to be gone


def check_in_place_args(args) -> None:
    """--in-place: a training script, one node, --max-restarts >= 1, the agent's own rendezvous; --spares K
    (K >= 0) only with it."""
    spares = getattr(args, "spares", None)
    if spares is not None and spares < 0:
        raise UsageError(f"--spares takes a number of processes, 0 or more, not {spares}")
    if not args.in_place:
        if spares is not None:
            raise UsageError("--spares needs --in-place: only an in-place recovery hands a failed rank's number "
                             "to a waiting process (without it, every rank is restarted)")
        return
    if args.module and args.config == "alpha_ckpt.job":
        raise UsageError("--in-place runs a training script that calls alpha_ckpt.run_resilient, not the built-in job")
    if args.max_restarts < 1:
        raise UsageError("--in-place needs --max-restarts N (N >= 1): it says what to do when a rank fails")
    if args.nnodes not in ("1", "1:1") or args.node_rank != 0:
        raise UsageError("--in-place runs on one node: drop --nnodes/--node-rank")
    given = [flag for flag, value in (("--master-addr", args.master_addr), ("--master-port", args.master_port),
                                      ("--rdzv-endpoint", args.rdzv_endpoint), ("--rdzv-backend", args.rdzv_backend),
                                      ("--rdzv-id", args.rdzv_id), ("--rdzv-conf", args.rdzv_conf),
                                      ("--local-addr", args.local_addr), ("--local-ranks-filter", args.local_ranks_filter),
                                      ("--standalone", args.standalone or None))
             if value is not None]
    if given:
        raise UsageError(f"--in-place hosts its own rendezvous on a free local port: drop {', '.join(given)}")
    if args.resume_from is not None:
        # Every rank's main() restores what the environment names, in every round: ROOT again, behind
        # what the rounds before published.
        raise UsageError("--in-place resumes the newest generation in every round: use --resume latest, "
                         "not --resume-from")


def worker_command(args) -> list[str]:
    """``python -m alpha_ckpt.launch.script_runner`` with the script (or -m module) and its own arguments."""
    target = ["-m", args.config] if args.module else [os.path.abspath(args.config)]
    return [sys.executable, "-m", "alpha_ckpt.launch.script_runner", *target, *args.script_args]


def worker_environment(base: dict, *, rank: int, world: int, round_: int, port: int, control_port: int,
                       run_id: str, max_restarts: int, timeout: float,
                       heartbeat_period: float | None = None) -> dict[str, str]:
    """The environment torchrun gives a worker on one node, the control store's address, and (with
    ``heartbeat_period``) the beats it sends there."""
    env = dict(base)
    env.update({
        "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
        "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world),
        "ROLE_NAME": "default", "MASTER_ADDR": HOST, "MASTER_PORT": str(port),
        "TORCHELASTIC_RESTART_COUNT": str(round_), "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
        "TORCHELASTIC_RUN_ID": run_id,
        # Every rank is a client of the round's store, which this agent hosts (as under torchrun).
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        CONTROL: f"{HOST}:{control_port}", TIMEOUT: str(timeout),
    })
    if heartbeat_period is not None:
        env.update(launch_env.heartbeat_environment(f"{HOST}:{control_port}", heartbeat_period))
    if world > 1 and "OMP_NUM_THREADS" not in base:
        env["OMP_NUM_THREADS"] = "1"  # as torchrun: ranks on one host must not oversubscribe its cores
    return env


class Action(enum.Enum):
    DONE = "done"  # exit 0: this rank finished
    STOP = "stop"  # a refusal or a usage error: stop every rank, exit with its code
    REPLACE = "replace"  # fell with the failure that began the current round: replaced in it, no restart counted
    NEW_ROUND = "new_round"  # a failure of its own: round r + 1 and one replacement
    EXHAUSTED = "exhausted"  # a failure and no restart left: stop every rank, exit 75
    OWN_ERROR = "own_error"  # the script's own error before any checkpoint call: stop every rank, exit 1


def on_exit(code: int, *, started_in: int, round_: int, joined: bool, restarts: int, max_restarts: int,
            before_checkpoint: bool = False) -> Action:
    """What the agent does when a rank exits with ``code``: the rank's process was started in round
    ``started_in``, the current round is ``round_``, ``joined``: the rank joined the current round's group,
    ``before_checkpoint``: its error came before any checkpoint call of its round
    (:func:`alpha_ckpt.runtime.launch_env.failed_before_checkpoint`)."""
    if code == 0:
        return Action.DONE
    if code in (EXIT_REFUSED, EXIT_USAGE):
        return Action.STOP
    if started_in < round_ and not joined:
        return Action.REPLACE
    if before_checkpoint:
        return Action.OWN_ERROR
    return Action.NEW_ROUND if restarts < max_restarts else Action.EXHAUSTED


@dataclass
class Ranks:
    """What the agent knows of its ranks: the process of each, and the round it was started in."""
    procs: dict = field(default_factory=dict)  # rank -> Popen
    started_in: dict = field(default_factory=dict)  # rank -> round its process was started in
    done: set = field(default_factory=set)  # ranks that exited 0


def run_in_place(args, env: dict | None = None) -> int:
    """Start ``args.nproc`` ranks of ``args``' script and keep them going (the module docstring); the exit status."""
    import subprocess
    from datetime import timedelta

    from torch.distributed import TCPStore

    world, timeout = args.nproc, float(args.timeout)
    period = args.heartbeat_period
    base = launch_env.launcher_environment() if env is None else dict(env)
    run_id = uuid.uuid4().hex[:12]
    store_timeout = timedelta(seconds=timeout)
    control = TCPStore(HOST, 0, world + 1, True, timeout=store_timeout, wait_for_workers=False)
    rendezvous = {}  # round -> its TCPStore (the server lives while the object does)
    state = Ranks()
    interrupted: list[int] = []
    wanted_spares = 1 if args.spares is None else args.spares
    spares: list = []  # (Popen, number): the next replacements, torch imported, no rank yet
    spares_started: list[int] = []
    spares_lost: list[int] = []  # the numbers of spares that died while they waited
    launch_dir = base.get(launch_env.LAUNCH_DIR, "")
    watcher = heartbeat.Watcher(control, args.heartbeat_limit, startup=timeout) if period is not None else None
    hung: dict[int, heartbeat.Hung] = {}  # rank -> how it was found hung, until its exit is handled

    def begin_round(r: int, failed: int | None, code: int | None) -> int:
        rendezvous[r] = TCPStore(HOST, 0, world, True, timeout=store_timeout, wait_for_workers=False)
        control.set(round_key(r), json.dumps({"round": r, "port": rendezvous[r].port, "failed_rank": failed,
                                              "exit": code, "detected_at": time.time()}))
        control.set(ROUND_KEY, str(r))
        # A rank still joining an older round would wait there for a peer that is gone: closing the
        # older stores answers its wait at once, and it joins the newest round instead.
        for old in [k for k in rendezvous if k < r]:
            del rendezvous[old]
        return rendezvous[r].port

    def environment(rank: int, r: int) -> dict[str, str]:
        return worker_environment(base, rank=rank, world=world, round_=r, port=rendezvous[r].port,
                                  control_port=control.port, run_id=run_id, max_restarts=args.max_restarts,
                                  timeout=timeout, heartbeat_period=period)

    def start(rank: int, r: int) -> None:
        env = environment(rank, r)
        while spares:
            proc, number = spares.pop(0)
            if proc.poll() is None:
                control.set(spare_key(number), json.dumps({k: v for k, v in env.items() if base.get(k) != v}))
                state.procs[rank] = proc
                break
            spares_lost.append(number)  # died while it waited: the next one, or a new process, takes the rank
            print(f"alpha-run: spare {number} died while it waited ({describe_exit(proc.returncode)}); "
                  "the job goes on", file=sys.stderr)
        else:
            # a Ctrl-C reaches this agent, which stops the ranks in order
            state.procs[rank] = subprocess.Popen(worker_command(args), env=env, start_new_session=True)
        state.started_in[rank] = r

    def start_spare(prepare: bool) -> None:
        """A process that imports torch and alpha_ckpt now and becomes the next replacement (:func:`spare_main`);
        with ``prepare``, it runs the script up to ``run_resilient``'s ``prepare`` too."""
        number = len(spares_started)
        env = {**base, CONTROL: f"{HOST}:{control.port}", TIMEOUT: str(timeout)}
        if period is not None:  # it beats once it takes a rank
            env.update(launch_env.heartbeat_environment(f"{HOST}:{control.port}", period))
        if world > 1 and "OMP_NUM_THREADS" not in base:
            env["OMP_NUM_THREADS"] = "1"  # read when torch is imported: the rank's value, before its rank is known
        command = [sys.executable, "-m", "alpha_ckpt.launch.inplace", "--spare", str(number),
                   "prepare" if prepare else "import", *worker_command(args)[3:]]
        spares_started.append(number)
        spares.append((subprocess.Popen(command, env=env, start_new_session=True), number))

    def refill_spares(r: int) -> None:
        """Up to ``--spares`` waiting processes while a restart remains, started once every rank joined
        round ``r`` (scripts that call run_resilient) and finished a step of it (:func:`launch_env.note_step`):
        starting a process costs CPU that the start or a recovery would otherwise have. A spare that died while waiting is counted and replaced;
        after ``--spares`` + ``--max-restarts`` such deaths none is started again (each would die too), and
        a failed rank gets a new process, as with ``--spares 0``."""
        for proc, number in [each for each in spares if each[0].poll() is not None]:
            spares.remove((proc, number))
            spares_lost.append(number)
            print(f"alpha-run: spare {number} died while it waited ({describe_exit(proc.returncode)}); "
                  "the job goes on", file=sys.stderr)
        # Not capped by the restarts left: ranks that fail together take one restart and a spare each.
        room = wanted_spares - len(spares) if restarts < args.max_restarts else 0
        if room <= 0 or len(spares_lost) >= wanted_spares + args.max_restarts:
            return
        # Only for ranks that join rounds (run_resilient): a script that does not dies whole with its peer,
        # and every rank of it then starts as a new process anyway.
        if not everyone_joined(r):
            return
        if not launch_dir or all(launch_env.noted(launch_dir, "stepped", r, rank) for rank in range(world)):
            # Where the script's ranks hand run_resilient a prepare (each process notes it in the round it
            # started in), a spare runs the script up to it: the model is built before any rank fails.
            prepare = bool(launch_dir) and all(launch_env.noted(launch_dir, "prepares", state.started_in[rank], rank)
                                               for rank in state.procs)
            for _ in range(room):
                start_spare(prepare)

    def what_happened(rank: int, code: int) -> str:
        each = hung.pop(rank, None)
        return each.describe() if each is not None else f"failed ({describe_exit(code)})"

    def everyone_joined(r: int) -> bool:
        return control.check([joined_key(r, rank) for rank in range(world)])

    def on_signal(signum, _frame):
        interrupted.append(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    r, restarts = 0, 0
    try:
        begin_round(0, None, None)
        for rank in range(world):
            start(rank, 0)
        while True:
            if interrupted:
                return EXIT_INTERRUPTED
            # A hung rank is killed and gone before its exit is handled below: nothing takes its number
            # while it lives, and it is the failure of the round it begins.
            running = {rank: proc.pid for rank, proc in state.procs.items() if proc.poll() is None}
            for each in watcher.hung(running) if watcher else ():
                heartbeat.kill(each.pid)  # not reaped yet (polled above): the pid is still the rank's
                try:
                    state.procs[each.rank].wait(timeout=KILLED_GONE_S)
                except subprocess.TimeoutExpired:  # in the kernel, uninterruptible: it dies when it leaves
                    continue
                hung[each.rank] = each
            exited = [(rank, proc.returncode) for rank, proc in list(state.procs.items()) if proc.poll() is not None]
            # A rank killed by a signal first: the others' failures in the same look may follow from it.
            for rank, code in sorted(exited, key=lambda item: (item[1] >= 0, item[0])):
                del state.procs[rank]
                cause = what_happened(rank, code)
                action = on_exit(code, started_in=state.started_in[rank], round_=r,
                                 joined=code != 0 and control.check([joined_key(r, rank)]),
                                 restarts=restarts, max_restarts=args.max_restarts,
                                 before_checkpoint=launch_env.failed_before_checkpoint(
                                     base.get(launch_env.LAUNCH_DIR, ""), r, rank, code))
                if action is Action.DONE:
                    state.done.add(rank)
                elif action is Action.STOP:
                    return code
                elif action is Action.OWN_ERROR:
                    print(f"alpha-run: rank {rank} failed ({describe_exit(code)}) before any checkpoint call of round "
                          f"{r}: the script's own error (above), which a restart would meet again; not restarted",
                          file=sys.stderr)
                    return EXIT_SCRIPT_ERROR
                elif action is Action.REPLACE:
                    start(rank, r)
                elif action is Action.EXHAUSTED:
                    print(f"alpha-run: rank {rank} {cause}; no restart left of "
                          f"--max-restarts {args.max_restarts}; retry with --resume latest", file=sys.stderr)
                    return EXIT_RETRY
                else:
                    restarts, r = restarts + 1, r + 1
                    begin_round(r, rank, code)
                    print(f"alpha-run: rank {rank} {cause}; round {r}: rank {rank} restarted, "
                          f"the others recover in place (restart {restarts} of {args.max_restarts})",
                          file=sys.stderr)
                    start(rank, r)
            if not state.procs:
                return EXIT_OK
            refill_spares(r)
            time.sleep(POLL_S)
    finally:
        stop(list(state.procs.values()) + [proc for proc, _ in spares])
        for s, handler in previous.items():
            signal.signal(s, handler)



def stop(procs: list) -> None:
    """SIGTERM to each process group this agent started, SIGKILL to what is left after :data:`STOP_GRACE_S`."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = [p for p in procs if p.poll() is None]
        for proc in alive:
            try:
                os.killpg(proc.pid, sig)  # the rank and what it started (its own session)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + STOP_GRACE_S
        while alive and time.monotonic() < deadline:
            alive = [p for p in alive if p.poll() is None]
            time.sleep(POLL_S)
        if not alive:
            return
    for proc in procs:
        proc.wait()


def spare_main(argv: list[str]) -> None:
    """``python -m alpha_ckpt.launch.inplace --spare N import|prepare SCRIPT ARGS``: the next replacement, started
    before it is needed.

    It binds its life to the launcher and imports what every replacement imports first (torch,
    torch.distributed, torch._dynamo, which DistributedDataParallel's constructor imports, and
    alpha_ckpt's Checkpointer). ``import``: it then waits until the launcher hands it a rank's
    environment, and runs the script as :mod:`alpha_ckpt.launch.script_runner` does. ``prepare`` (a
    script that hands ``run_resilient`` a ``prepare``): it runs the script at once, rank-less, and
    ``run_resilient`` waits for the rank after ``prepare`` returned, so the script's imports and its
    model are ready when a rank fails. A script that fails or ends before that (its code before
    ``run_resilient`` reads the rank, say) is run again from its start once the rank is handed over.
    """
    from alpha_ckpt.runtime.lifeline import bind_to_named_launcher
    bind_to_named_launcher()
    number, mode, script = int(argv[1]), argv[2], argv[3:]
    import torch.distributed  # noqa: F401 - imported here, off the recovery's path
    try:
        import torch._dynamo  # noqa: F401
    except ImportError:
        pass
    from alpha_ckpt import collective  # noqa: F401
    from alpha_ckpt.launch import resilient
    from alpha_ckpt.launch.script_runner import _leave_group, exit_now
    from alpha_ckpt.launch.script_runner import main as run_script

    def run():
        try:
            return run_script(script)
        except SystemExit as exc:
            _leave_group()
            return exc.code

    status = None
    if mode == "prepare":
        resilient._SPARE_HANDOFF.append(lambda: _take_rank(number))
        try:
            status = run()
        except BaseException:  # noqa: BLE001 - re-raised below once it is the rank's own
            if not resilient._SPARE_HANDOFF:
                raise
    if mode != "prepare" or resilient._SPARE_HANDOFF:
        # Not run rank-less, or its script ended before run_resilient took a rank for it (code before
        # run_resilient that reads the rank, say): wait for the rank and run the script as a new process would.
        resilient._SPARE_HANDOFF.clear()
        _take_rank(number)
        status = run()
    exit_now(status)


def _take_rank(number: int) -> None:
    """Wait for the launcher to hand spare ``number`` a rank (its death ends this process: the lifeline),
    then become that rank: its environment, its fault points and its heartbeats."""
    from datetime import timedelta

    from torch.distributed import TCPStore
    host, port = launch_env.in_place_settings()[0].rsplit(":", 1)
    control = TCPStore(host, int(port), is_master=False, timeout=timedelta(days=365))
    control.wait([spare_key(number)])
    launch_env.adopt(json.loads(control.get(spare_key(number)).decode()))
    del control
    from alpha_ckpt.runtime.faults import install_from_environment
    install_from_environment()
    heartbeat.start_from_environment()  # a rank now: the launcher watches its beats
    heartbeat.bound_collectives_from_environment()


if __name__ == "__main__" and sys.argv[1:2] == ["--spare"]:
    spare_main(sys.argv[1:])
