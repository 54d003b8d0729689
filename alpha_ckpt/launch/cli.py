"""alpha-ckpt: inspect, verify, export, pin and collect a store.

    alpha-ckpt list    --store DIR [--run R] [--step S] [--json]
    alpha-ckpt inspect --store DIR ROOT [--json]
    alpha-ckpt verify  --store DIR ROOT [--json]
    alpha-ckpt export  --store DIR ROOT --to PATH [--format safetensors|torch] [--json]
    alpha-ckpt latest  --store DIR --run R --step S [--json]
    alpha-ckpt gc      --store DIR [--keep K] [--grace SECONDS] [--completed-steps] [--dry-run] [--json]
    alpha-ckpt pin     --store DIR ROOT [--note TEXT] [--json]
    alpha-ckpt unpin   --store DIR ROOT [--json]
    alpha-ckpt pins    --store DIR [--json]

ROOT is a generation's root digest (64 hex), as ``alpha_ckpt.save`` returns it. The JSON
outputs name it ``root``.

Exit codes: 0 done (verify: valid), 3 refused (the code and message are one
line on stderr; ``latest``: no complete generation; ``unpin``: not pinned),
2 usage error (one line on stderr: a bad name, digest, ``--keep`` or
``--grace``, or a store that is not one), 1 export could not write its file,
or the store cannot be written (gc, pin, unpin on a read-only store: one line
says so). stdout holds only the answer: with ``--json`` one JSON document,
a refusal's included.

Entries of the store that alpha_ckpt never writes where they are (a FIFO,
a directory or a symlink where a file is expected, a file where a directory
is) are skipped with one warning line each on stderr and left as they are.

verify and export draw a progress bar on stderr when it is a terminal;
otherwise verify, export and gc write one JSON event line to stderr when
they end (stdout is unchanged).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import errno
import json
import math
import os
import sys
import time
from typing import Iterator, Sequence

from alpha_ckpt.errors import Refusal, StoreUsageError
from alpha_ckpt.upkeep.export import FORMATS, check_destination, export_bytes, export_opened, format_for
from alpha_ckpt.format.records import NAME_RE, is_digest
from alpha_ckpt.upkeep.gc import DEFAULT_GRACE_S, apply_gc, plan_gc
from alpha_ckpt.upkeep.pins import MAX_NOTE_CHARS, Pin, list_pins, pin_generation, unpin_generation
from alpha_ckpt.runtime.progress import Progress, emit, is_tty
from alpha_ckpt.generation.reader import check_payloads, latest_generation, open_generation, payload_bytes
from alpha_ckpt.store import RefRecord, Store

EXIT_OK, EXIT_WRITE_FAILED, EXIT_USAGE, EXIT_REFUSED = 0, 1, 2, 3


def _root_arg(value: str) -> str:
    if not is_digest(value):
        raise argparse.ArgumentTypeError(f"{value!r} is not a full 64-hex root digest")
    return value


def _name_arg(value: str) -> str:
    if not NAME_RE.match(value):
        raise argparse.ArgumentTypeError(f"{value!r} is not a plain run or step name ([A-Za-z0-9._-], 1-128 "
                                         "chars, starting with a letter or digit)")
    return value


def _keep_arg(value: str) -> int:
    try:
        keep = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number") from None
    if keep < 2:
        raise argparse.ArgumentTypeError(f"{keep}: at least two generations are kept (the previous complete one "
                                         "must survive a failed publish)")
    return keep


def _grace_arg(value: str) -> float:
    try:
        grace = float(value)
    except ValueError:
        grace = math.nan
    if not (math.isfinite(grace) and grace >= 0):
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of seconds (finite, not negative)")
    return grace


class _BadArguments(Exception):
    """argparse's verdict on the command line: one line, which :func:`main` writes on stderr (exit 2)."""


class _OneLineParser(argparse.ArgumentParser):
    """A usage error is one line (exit 2), as every other usage error of alpha-ckpt, not argparse's usage block."""

    def error(self, message: str):
        raise _BadArguments(f"{self.prog}: {' '.join(message.split())} (see {self.prog} --help)")


def _parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="alpha-ckpt", description="Inspect and verify an alpha_ckpt store.")
    sub = parser.add_subparsers(dest="command", required=True)  # subcommands' parsers are of the same class
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--store", required=True, help="store directory")
    common.add_argument("--json", action="store_true", help="machine-readable output")
    p = sub.add_parser("list", parents=[common], help="generations of a run/step (default: all)")
    p.add_argument("--run", type=_name_arg)
    p.add_argument("--step", type=_name_arg)
    p = sub.add_parser("latest", parents=[common], help="newest complete generation of a run/step (validated)")
    p.add_argument("--run", required=True, type=_name_arg)
    p.add_argument("--step", required=True, type=_name_arg)
    for name, text in (("inspect", "manifest, regions and shards of a generation"),
                       ("verify", "validate every object of a generation (exit 3 when refused)")):
        p = sub.add_parser(name, parents=[common], help=text)
        p.add_argument("root", type=_root_arg, metavar="ROOT", help="the generation's root digest (64 hex)")
    p = sub.add_parser("export", parents=[common], help="write a generation's full logical state to a new file (validated first)",
                       description="Validate every object read, then write each region at its full shape under its "
                                   "dotted name. The file is new: an existing PATH is refused, never overwritten.")
    p.add_argument("root", type=_root_arg, metavar="ROOT", help="the generation's root digest (64 hex)")
    p.add_argument("--to", required=True, metavar="PATH", help="the file to create")
    p.add_argument("--format", choices=FORMATS,
                   help="safetensors (default), or torch: a torch.save pickle of a flat dict, for "
                        "torch.load(PATH, weights_only=True) outside alpha_ckpt (alpha_ckpt never reads it back); "
                        "default torch when PATH ends in .pt or .pth")
    p = sub.add_parser("gc", parents=[common], help="remove stale temp files, old generations, unreachable objects")
    p.add_argument("--keep", type=_keep_arg, help="keep the K newest generations of each run/step (K >= 2; default all)")
    p.add_argument("--grace", type=_grace_arg, default=DEFAULT_GRACE_S,
                   help=f"never remove objects or temp files younger than this many seconds (default {DEFAULT_GRACE_S:g})")
    p.add_argument("--completed-steps", action="store_true",
                   help="also remove every generation of a run/step published before its declared output "
                        "(STORE/outputs/RUN/STEP/*.safetensors); pinned ones stay")
    p.add_argument("--dry-run", action="store_true", help="only say what would be removed")
    p = sub.add_parser("pin", parents=[common], help="keep a published, valid generation whatever the retention")
    p.add_argument("root", type=_root_arg, metavar="ROOT", help="the generation's root digest (64 hex)")
    p.add_argument("--note", default="", help=f"why it is kept (at most {MAX_NOTE_CHARS} characters)")
    p = sub.add_parser("unpin", parents=[common], help="remove a pin (gc may then remove the generation)")
    p.add_argument("root", type=_root_arg, metavar="ROOT", help="the generation's root digest (64 hex)")
    sub.add_parser("pins", parents=[common], help="the pinned generations")
    return parser


def _ref_json(r: RefRecord) -> dict:
    return {"run": r.run, "step": r.step, "generation": r.generation, "root": r.root, "update": r.prefix.update,
            "cursor": r.prefix.cursor, "epoch": r.prefix.epoch, "owners": r.owners, "bytes": r.bytes,
            "published_at": r.published_at}


@contextlib.contextmanager
def _logged(event: str, err, **fields) -> Iterator[dict]:
    """One JSON event line on stderr when the command ends, unless stderr is a terminal (a person reads stdout)."""
    started = time.monotonic()
    fields["outcome"] = "error"
    try:
        yield fields
        fields["outcome"] = "ok"
    except Refusal as refusal:
        fields.update(outcome="refused", code=refusal.code.value)
        raise
    except StoreUsageError:
        fields["outcome"] = "usage-error"
        raise
    except Exception as exc:
        fields["error"] = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        if not is_tty(err):
            emit(event, err, **fields, seconds=round(time.monotonic() - started, 6))


def cmd_list(store: Store, args, out, err) -> int:
    pairs = [(run, step) for run, step in store.runs()
             if (args.run is None or run == args.run) and (args.step is None or step == args.step)]
    rows, problems = [], []
    for run, step in pairs:
        for record in store.list_refs(run, step):
            if isinstance(record, Refusal):
                problems.append({"run": run, "step": step, "code": record.code.value, "message": record.message})
            else:
                rows.append(_ref_json(record))
    if args.json:
        print(json.dumps({"generations": rows, "unreadable_refs": problems}), file=out)
        return EXIT_OK
    print(f"{'run/step':<24} {'gen':>5} {'root':<64} {'update':>7} {'cursor':>9} {'epoch':>5} {'owners':>6} {'bytes':>12}  time",
          file=out)
    for r in rows:
        when = datetime.datetime.fromtimestamp(r["published_at"], datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        print(f"{r['run'] + '/' + r['step']:<24} {r['generation']:>5} {r['root']} {r['update']:>7} {r['cursor']:>9} "
              f"{r['epoch']:>5} {r['owners']:>6} {r['bytes']:>12}  {when}", file=out)
    for p in problems:
        print(f"unreadable ref in {p['run']}/{p['step']}: [{p['code']}] {p['message']}", file=out)
    return EXIT_OK


def cmd_inspect(store: Store, args, out, err) -> int:
    with open_generation(store, args.root) as generation:
        m = generation.manifest

        def shard_info(rec):
            return {"digest": rec.digest, "bytes": rec.size,
                    "slices": [{"ordinal": s.ordinal, "region": m.regions[s.ordinal].name, "lo": s.lo, "hi": s.hi,
                                "offset": s.offset, "stored": s.stored, "raw": s.raw, "codec": s.codec,
                                "blake3": s.blake3} for s in generation.shards[rec.digest][1].slices]}
        info = {
            "digest": m.digest, "bytes": m.size, "prefix": m.prefix.to_json(), "schema_digest": m.schema_digest,
            "owners": m.owners, "metadata": m.metadata, "publisher": m.publisher.to_json(),
            "regions": [r.to_json() | {"words": r.words} for r in m.regions],
            "shards": [shard_info(rec) for rec in m.shards],
            "children": [c.to_json() for c in m.children],
            # A tree's group manifests, the root first (a star has only its root).
            "groups": [{"digest": g.digest, "bytes": g.size, "role": g.publisher.role, "subtree": g.publisher.subtree,
                        "children": [c.to_json() for c in g.children], "shards": [shard_info(r) for r in g.shards]}
                       for g in generation.manifests] if m.publisher.kind == "tree" else [],
        }
    if args.json:
        print(json.dumps(info), file=out)
        return EXIT_OK
    p = m.prefix
    print(f"manifest {m.digest}  ({m.size} bytes)", file=out)
    print(f"  capture  run={p.run} step={p.step} update={p.update} cursor={p.cursor} epoch={p.epoch} owners={m.owners}", file=out)
    publisher = m.publisher
    print("  publisher star" if publisher.kind == "star" else
          f"  publisher tree, fan-out {publisher.fanout}, {len(info['groups'])} group manifests", file=out)
    print(f"  schema   {m.schema_digest}  ({len(m.regions)} regions)", file=out)
    for r in info["regions"]:
        print(f"    [{r['ordinal']}] {r['name']}  {r['dtype']}{r['shape']}  {r['words']} words", file=out)
    groups = info["groups"] or [{"role": None, "digest": m.digest, "children": [], "shards": info["shards"]}]
    for g in groups:
        if g["role"] is not None:
            kids = ", ".join(f"role {c['role']} ({c['size']})" for c in g["children"]) or "none"
            print(f"  group role {g['role']}, subtree {g['subtree']}  {g['digest']}  children: {kids}", file=out)
        for s in g["shards"]:
            print(f"  shard {s['digest']}  ({s['bytes']} bytes)", file=out)
            for sl in s["slices"]:
                print(f"    [{sl['ordinal']}] {sl['region']} words [{sl['lo']}, {sl['hi']})  {sl['codec']} "
                      f"{sl['stored']} bytes at {sl['offset']}", file=out)
    return EXIT_OK


def _warn_skipped(path_and_why: str, err) -> None:
    print(f"alpha-ckpt: warning: skipped {path_and_why}", file=err)


def cmd_gc(store: Store, args, out, err) -> int:
    with _logged("gc", err, dry_run=args.dry_run) as log:
        plan = plan_gc(store, keep=args.keep, grace=args.grace, completed_steps=args.completed_steps)
        planned = len(plan.skipped)
        for entry in plan.skipped:
            _warn_skipped(entry, err)
        if not args.dry_run:
            apply_gc(store, plan)
        for entry in plan.skipped[planned:]:  # met while removing
            _warn_skipped(entry, err)
        log.update(generations=len(plan.refs), objects=len(plan.objects), tmp=len(plan.tmp),
                   kept_generations=plan.kept_generations, unreadable=len(plan.unreadable),
                   quarantine=len(plan.quarantine), skipped=len(plan.skipped))
    if args.json:
        print(json.dumps({**plan.to_json(), "dry_run": args.dry_run}), file=out)
    else:
        verb = "would remove" if args.dry_run else "removed"
        print(f"{verb} {len(plan.refs)} generations, {len(plan.objects)} unreachable objects, {len(plan.tmp)} temp "
              f"files, {len(plan.leases)} stale leases, {len(plan.quarantine)} quarantined entries; "
              f"kept {plan.kept_generations} generations "
              f"({plan.pinned} pinned, {plan.reachable} objects reachable); {plan.live_leases} publishes in flight",
              file=out)
        for step in plan.completed:
            print(f"  {step}: its declared output is published, its checkpoints are discarded", file=out)
        for root in plan.unreadable:
            print(f"  no object removed: the manifests of kept generation {root} cannot be read", file=out)
        for entry in plan.damaged_refs:
            print(f"  {'would set' if args.dry_run else 'set'} aside unreadable ref {entry.name}: {entry.refusal}",
                  file=out)
        for line in plan.unreadable_refs:
            print(f"  unreadable ref {line}", file=out)
        if plan.held_by_refs:
            print(f"  no object removed: ref {plan.held_by_refs[0]} cannot be read, so what it reaches cannot be "
                  "told", file=out)
    return EXIT_OK


def _when(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def cmd_pin(store: Store, args, out, err=None) -> int:
    try:
        pin, new = pin_generation(store, args.root, args.note)
    except ValueError as exc:
        raise StoreUsageError(str(exc)) from None
    if args.json:
        print(json.dumps({**pin.to_json(), "new": new}), file=out)
    else:
        print(f"{'pinned' if new else 'already pinned'} {pin.root} ({pin.run}/{pin.step} generation "
              f"{pin.generation}, since {_when(pin.pinned_at)})", file=out)
    return EXIT_OK


def cmd_unpin(store: Store, args, out, err=None) -> int:
    removed = unpin_generation(store, args.root)
    if args.json:
        print(json.dumps({"root": args.root, "unpinned": removed}), file=out)
    else:
        if removed:
            print(f"unpinned {args.root}", file=out)
        else:
            print(f"alpha-ckpt: not pinned: {args.root}", file=err or sys.stderr)
    return EXIT_OK if removed else EXIT_REFUSED


def cmd_pins(store: Store, args, out, err=None) -> int:
    pins = list_pins(store, on_hostile=lambda path, why: _warn_skipped(f"{path}: {why}", err or sys.stderr))
    if args.json:
        print(json.dumps({"pins": [p.to_json() for p in pins if isinstance(p, Pin)],
                          "unreadable_pins": [{"root": root, "code": r.code.value, "message": r.message}
                                              for root, r in (p for p in pins if not isinstance(p, Pin))]}), file=out)
        return EXIT_OK
    for p in pins:
        if isinstance(p, Pin):
            print(f"{p.root}  {p.run}/{p.step} generation {p.generation}  pinned {_when(p.pinned_at)}"
                  + (f"  {p.note}" if p.note else ""), file=out)
        else:
            root, refusal = p
            print(f"{root}  unreadable pin (still kept): [{refusal.code.value}] {refusal.message}", file=out)
    return EXIT_OK


def cmd_verify(store: Store, args, out, err) -> int:
    with _logged("verify", err, root=args.root) as log:
        # verify_generation, opened here so the bar knows the total before hashing starts.
        with open_generation(store, args.root) as generation:
            total = payload_bytes(generation)
            with Progress("verify", total, err) as bar:
                check_payloads(generation, advance=bar.advance)
        log["bytes"] = total
    if args.json:
        print(json.dumps({"root": args.root, "valid": True}), file=out)
    else:
        print(f"valid {args.root}", file=out)
    return EXIT_OK


def cmd_export(store: Store, args, out, err) -> int:
    fmt = format_for(args.to, args.format)
    path = os.path.abspath(args.to)
    try:
        with _logged("export", err, root=args.root, format=fmt, path=path) as log:
            check_destination(path)  # a taken path is refused before anything is read
            with open_generation(store, args.root) as generation:
                with Progress("export", export_bytes(generation), err) as bar:
                    result = export_opened(generation, path, fmt, advance=bar.advance)
            log.update(bytes=result.bytes, validated_bytes=result.validated_bytes, regions=len(result.regions))
    except OSError as exc:  # the file system refused the write (ENOSPC, EACCES, EIO); no temp file is left
        print(f"alpha-ckpt: export to {path} failed: {exc}", file=err)
        return EXIT_WRITE_FAILED
    if args.json:
        print(json.dumps(result.to_json()), file=out)
    else:
        print(f"exported {result.root} to {result.path} ({result.format}, {len(result.regions)} regions, "
              f"{result.bytes} bytes)", file=out)
    return EXIT_OK


def cmd_latest(store: Store, args, out, err) -> int:
    record, skipped = latest_generation(store, args.run, args.step)
    why = [{"root": d, "code": r.code.value, "message": r.message} for d, r in skipped]
    if args.json:
        print(json.dumps({"latest": _ref_json(record) if record else None, "skipped": why}), file=out)
    else:
        # stdout is the root alone (ROOT=$(alpha-ckpt latest ...)); what was passed over goes to stderr.
        for s in why:
            print(f"alpha-ckpt: skipped {s['root']}: [{s['code']}] {s['message']}", file=err)
        if record:
            print(record.root, file=out)
        else:
            print(f"alpha-ckpt: no complete generation of {args.run}/{args.step}", file=err)
    return EXIT_OK if record else EXIT_REFUSED


def main(argv: Sequence[str] | None = None, out=None, err=None) -> int:
    out = out or sys.stdout
    err = err or sys.stderr
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except _BadArguments as exc:
        print(exc, file=err)
        return EXIT_USAGE
    except SystemExit as exc:  # --help
        return EXIT_USAGE if exc.code else EXIT_OK
    try:
        store = Store(args.store, create=False)
    except StoreUsageError as exc:
        print(f"alpha-ckpt: {exc}", file=err)
        return EXIT_USAGE
    except Refusal as refusal:
        return _refused(refusal, args, out, err)
    try:
        return {"list": cmd_list, "inspect": cmd_inspect, "verify": cmd_verify, "export": cmd_export,
                "latest": cmd_latest, "gc": cmd_gc, "pin": cmd_pin, "unpin": cmd_unpin,
                "pins": cmd_pins}[args.command](store, args, out, err)
    except Refusal as refusal:
        return _refused(refusal, args, out, err)
    except StoreUsageError as exc:
        print(f"alpha-ckpt: {exc}", file=err)
        return EXIT_USAGE
    except OSError as exc:
        if exc.errno not in _NOT_WRITABLE:
            raise
        # A read-only file system or missing permission: say so in one line, not a traceback.
        print(f"alpha-ckpt: {args.command}: the store {store.root} cannot be written here "
              f"({os.strerror(exc.errno)}); it stopped there", file=err)
        return EXIT_WRITE_FAILED
    finally:
        store.close()


_NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)


def _refused(refusal: Refusal, args, out, err) -> int:
    """A refusal: with --json the answer on stdout (one JSON document), else one line on stderr."""
    if args.json:
        root = getattr(args, "root", None)
        print(json.dumps({"root": root, "valid": False, "code": refusal.code.value,
                          "message": refusal.message}), file=out)
    else:
        print(f"alpha-ckpt: refused {refusal.code.value}: {refusal.message}", file=err)
    return EXIT_REFUSED


def entry() -> None:
    from alpha_ckpt.runtime.faults import install_from_environment
    install_from_environment()  # the fault points a test asks of this command, if any
    sys.exit(main())


if __name__ == "__main__":
    entry()
