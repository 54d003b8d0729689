"""``python -m bench SUITE [SUITE ...] [options]``: run benchmark suites by name; with no suite, list them.

Every suite prints its own progress and figures, then one JSON record (the last line of the output:
the suites, the options, the code's commit and the machine beside the figures; see :mod:`bench.record`).
``--out FILE`` also writes that record to FILE. ``python -m bench SUITE --help`` describes a suite's options.
"""
from __future__ import annotations

import datetime
import importlib
import json
import sys
import time

# name: (module, what it measures). The save-and-restore suites share one state and one set of
# options, so several of them may run in one invocation; every other suite runs alone.
SUITES = {
    "store": ("save_restore", "one process: save and restore, ours against torch.save, DCP and raw disk"),
    "stall": ("save_restore", "training stall of synchronous and asynchronous saves, ours against DCP's"),
    "owners": ("save_restore", "1, 2 and 4 owner processes (tree publisher) against DCP with a process group"),
    "checkpointer": ("save_restore", "the collective Checkpointer (star, tree) against DCP on 2 and 4 ranks"),
    "sharded": ("save_restore", "DTensor Shard(0) state: Checkpointer and alpha_ckpt.dcp against DCP's own"),
    "many-tensors": ("save_restore", "states of 1,000 to 100,000 small tensors: ours against torch.save and DCP"),
    "recovery": ("recovery", "a SIGKILLed rank of a GPT DDP job: alpha-run's memory tier against torchrun + DCP"),
    "write-modes": ("write_modes", "buffered against O_DIRECT writes per file system, and what 'auto' picks"),
    "dedup": ("dedup", "what checking an existing object before reusing it costs in a re-save"),
    "capture": ("capture", "taking a training state as it comes against saving the same tensors as a flat dict"),
    "finite": ("finite", "publication's NaN/inf check: the same state published with and without it"),
    "tree": ("tree", "tree publication and path restore of up to 200,000 owners simulated in one process"),
    "sharded-restore": ("sharded_restore", "sharded restores alone, one save and one restore per method and round"),
    "sharded-saves": ("sharded_saves", "sharded saves alone, several ways, in paired balanced rounds"),
    "s3": ("s3", "sharded save and restore on an S3 server: ours against DCP on s3fs, s3torchconnector, a raw client"),
    "replicated-restore": ("replicated_restore", "replicated state restored on 4 ranks: each object read once per "
                           "node against every rank reading it, and DCP's load, on a file system and S3"),
}
GROUPED = "save_restore"


def usage() -> str:
    width = max(map(len, SUITES))
    return (__doc__.split("\n\n")[0] + "\n\nsuites:\n" +
            "\n".join(f"  {name:<{width}}  {what}" for name, (_, what) in SUITES.items()) + "\n")


def split_argv(argv: list[str]) -> tuple[list[str], list[str], str | None]:
    """The suite names (the leading words), the suite's own options, and ``--out``'s file."""
    names = []
    while argv and not argv[0].startswith("-"):
        names.append(argv.pop(0))
    rest, out = [], None
    while argv:
        arg = argv.pop(0)
        if arg == "--out":
            if not argv:
                raise SystemExit("bench: --out needs a file name")
            out = argv.pop(0)
        elif arg.startswith("--out="):
            out = arg.split("=", 1)[1]
        else:
            rest.append(arg)
    return names, rest, out


def suite_argv(names: list[str], rest: list[str]) -> tuple[str, list[str]]:
    """The module that runs ``names`` and its argument list; a usage error for an unknown name or a mix."""
    unknown = [n for n in names if n not in SUITES]
    if unknown:
        raise SystemExit(f"bench: unknown suite(s) {', '.join(unknown)}\n\n{usage()}")
    modules = {SUITES[n][0] for n in names}
    if len(modules) > 1 or (len(names) > 1 and modules != {GROUPED}):
        grouped = ", ".join(n for n, (m, _) in SUITES.items() if m == GROUPED)
        raise SystemExit(f"bench: only the save-and-restore suites ({grouped}) run together; run the others one "
                         "at a time")
    module = modules.pop()
    return module, (["--section", *names, *rest] if module == GROUPED else rest)


def main(argv: list[str] | None = None) -> dict | None:
    names, rest, out = split_argv(list(sys.argv[1:] if argv is None else argv))
    if not names:
        print(usage(), end="")
        return None
    module, args = suite_argv(names, rest)
    started, clock = datetime.datetime.now(datetime.timezone.utc), time.perf_counter()
    result = importlib.import_module(f"bench.{module}").main(args)
    if result is None:  # --help, or an internal rank process of a suite
        return None
    from bench.record import record
    line = record(names, rest, started, time.perf_counter() - clock, result)
    text = json.dumps(line, allow_nan=True)  # the suites' own key order (methods as run)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
    print(text, flush=True)
    return line


if __name__ == "__main__":
    main()
