"""Progress bars on a terminal, one JSON event line otherwise."""
import io
import time
import json
import math
import os
import subprocess
import re
import sys
from pathlib import Path

import pytest
import torch

import alpha_ckpt
from alpha_ckpt.launch import cli
from alpha_ckpt.runtime import progress
from alpha_ckpt.runtime.progress import EVENT_VERSION, EVENTS, Progress, emit
from alpha_ckpt.store import Store


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(progress, "_clock", fake)
    return fake


def test_progress_draws_a_bar_on_a_tty_and_finishes_with_a_newline(clock):
    tty = FakeTTY()
    with Progress("verify", 1 << 30, tty) as bar:
        clock.now += 0.3
        bar.advance(512 << 20)
    text = tty.getvalue()
    assert text.endswith("\n") and text.count("\n") == 1
    last = text.rstrip("\n").split("\r")[-1].rstrip()
    assert last == "verify [##########..........] 512.0 MiB / 1.0 GiB  1.8 GB/s"


def test_progress_redraws_at_most_ten_times_a_second(clock):
    tty = FakeTTY()
    with Progress("export", 10_000, tty) as bar:
        for _ in range(10_000):  # one simulated second, a byte every 0.1 ms
            clock.now += 1e-4
            bar.advance(1)
    draws = tty.getvalue().count("\r")
    assert 2 <= draws <= 10 + 2  # the first and the last draw come on top of the ten a second
    assert tty.getvalue().split("\r")[-1].rstrip() == "export [####################] 9.8 KiB / 9.8 KiB  10.0 kB/s"


def test_progress_draws_nothing_when_the_stream_is_not_a_tty(clock):
    log = io.StringIO()
    with Progress("verify", 100, log) as bar:
        clock.now += 1.0
        bar.advance(100)
    assert log.getvalue() == "" and bar.done_bytes == 100


def test_emit_writes_one_parseable_json_line():
    log = io.StringIO()
    emit("verify", log, root="ab" * 32, outcome="ok", seconds=0.5, bytes=5, note="two\nlines")
    text = log.getvalue()
    assert text.endswith("\n") and text.count("\n") == 1
    event = json.loads(text)
    assert (event["event"], event["bytes"], event["note"]) == ("verify", 5, "two\nlines")
    assert isinstance(event["time"], float)
    with pytest.raises(ValueError):
        emit("verify", io.StringIO(), root="ab" * 32, outcome="ok", seconds=math.nan)


def _events(text: str) -> list[dict]:
    """The JSON event lines of stderr (a refusal's or an error's own line beside them is text)."""
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_verify_emits_exactly_one_json_event_when_stderr_is_not_a_tty(saved):
    store_dir, root, _ = saved
    out, err = io.StringIO(), io.StringIO()
    assert cli.main(["verify", "--store", str(store_dir), root], out=out, err=err) == 0
    assert out.getvalue() == f"valid {root}\n"  # stdout as before
    assert len(err.getvalue().splitlines()) == 1  # the event alone
    (event,) = _events(err.getvalue())
    assert (event["event"], event["root"], event["outcome"]) == ("verify", root, "ok")
    assert event["bytes"] > 0 and event["seconds"] >= 0


def test_verify_draws_a_bar_and_no_json_on_a_tty(saved):
    store_dir, root, _ = saved
    err = FakeTTY()
    assert cli.main(["verify", "--store", str(store_dir), root], out=io.StringIO(), err=err) == 0
    text = err.getvalue()
    assert text.startswith("\rverify [") and text.endswith("\n") and "{" not in text


def test_a_refused_verify_logs_its_code_in_its_one_event(saved):
    store_dir, root, _ = saved
    with Store(store_dir) as s:
        shard = next(d for d in s.iter_objects() if d != root)
        path = s.object_path(shard)
    os.unlink(path)
    err = io.StringIO()
    assert cli.main(["verify", "--store", str(store_dir), root], out=io.StringIO(), err=err) == 3
    (event,) = _events(err.getvalue())
    assert (event["outcome"], event["code"]) == ("refused", "missing-shard")
    # The event, and the refusal's own line (the code and message) for a person.
    assert sorted(line.startswith("{") for line in err.getvalue().splitlines()) == [False, True]


@pytest.mark.timeout(120)
def test_the_console_script_writes_one_event_line_to_a_piped_stderr(saved):
    store_dir, root, _ = saved
    proc = subprocess.run([sys.executable, "-m", "alpha_ckpt.launch.cli", "verify", "--store", str(store_dir), root, "--json"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"root": root, "valid": True}
    (event,) = _events(proc.stderr)
    assert event["event"] == "verify" and event["outcome"] == "ok"


def test_gc_emits_one_event_with_the_counts_it_removed(saved):
    store_dir, _, _ = saved
    stray = store_dir / "tmp" / "4194305-dead.tmp"  # a pid above any pid_max: its writer cannot be running
    stray.write_bytes(b"left by a killed publisher")
    os.utime(stray, (time.time() - 60, time.time() - 60))  # older than gc's clock slack
    err = io.StringIO()
    assert cli.main(["gc", "--store", str(store_dir), "--grace", "0"], out=io.StringIO(), err=err) == 0
    (event,) = _events(err.getvalue())
    assert (event["event"], event["generations"], event["objects"], event["tmp"]) == ("gc", 0, 0, 1)


def test_the_verify_bar_counts_every_byte_once_when_verifiers_run_in_parallel(store_dir):
    # 4 MiB in two regions: above the size where validation runs on threads.
    root = alpha_ckpt.save({"a": torch.arange(1 << 19, dtype=torch.float32), "b": torch.ones(1 << 19)},
                           store=store_dir, run="r", step="s", update=1, cursor=1, epoch=0, max_shard_bytes=1 << 20)
    err = FakeTTY()
    assert cli.main(["verify", "--store", str(store_dir), root], out=io.StringIO(), err=err) == 0
    assert "] 4.0 MiB / 4.0 MiB  " in err.getvalue().split("\r")[-1]


def test_export_emits_one_event_naming_the_file_it_wrote(saved, tmp_path):
    store_dir, root, _ = saved
    err = io.StringIO()
    assert cli.main(["export", "--store", str(store_dir), root, "--to", str(tmp_path / "s.safetensors")],
                    out=io.StringIO(), err=err) == 0
    (event,) = _events(err.getvalue())
    assert (event["event"], event["format"], event["regions"], event["outcome"]) == ("export", "safetensors", 6, "ok")
    assert event["bytes"] == (tmp_path / "s.safetensors").stat().st_size
    assert event["path"] == str(tmp_path / "s.safetensors")
    err = io.StringIO()
    assert cli.main(["export", "--store", str(store_dir), root, "--to", str(tmp_path / "s.safetensors")],
                    out=io.StringIO(), err=err) == 2
    lines = err.getvalue().splitlines()
    assert [json.loads(l)["outcome"] for l in lines if l.startswith("{")] == ["usage-error"]
    assert any("already exists" in l for l in lines)


def test_the_export_bar_counts_bytes_validated_then_bytes_written(store_dir, tmp_path):
    root = alpha_ckpt.save({"a": torch.arange(1 << 19, dtype=torch.float32), "b": torch.ones(1 << 19)},
                           store=store_dir, run="r", step="s", update=1, cursor=1, epoch=0, max_shard_bytes=1 << 20)
    err = FakeTTY()
    assert cli.main(["export", "--store", str(store_dir), root, "--to", str(tmp_path / "x.safetensors")],
                    out=io.StringIO(), err=err) == 0
    assert "] 8.0 MiB / 8.0 MiB  " in err.getvalue().split("\r")[-1]  # 4 MiB read and validated, 4 MiB written


def test_every_event_line_carries_the_contract_version():
    log = io.StringIO()
    emit("fresh_start", log, run="r", step="s")
    event = json.loads(log.getvalue())
    assert (event["event"], event["version"], event["run"]) == ("fresh_start", EVENT_VERSION, "r")


def test_emit_refuses_an_unknown_event_or_one_missing_a_promised_field():
    with pytest.raises(TypeError):
        emit("no_such_event", io.StringIO())
    with pytest.raises(TypeError):
        emit("restored", io.StringIO(), run="r", step="s")  # no update, root, bytes_read
    with pytest.raises(TypeError):
        emit("fresh_start", io.StringIO(), run="r", step="s", version=2)


def _documented_events() -> dict[str, set[str]]:
    """docs/EVENTS.md's table: event -> the fields it always carries."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "EVENTS.md").read_text()
    table = {}
    for line in page.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`"):
            table[cells[0].strip("`")] = set(re.findall(r"`([a-z_]+)`", cells[2]))
    return table


def test_the_events_page_lists_every_event_with_the_fields_it_promises():
    assert _documented_events() == {name: set(fields) for name, fields in EVENTS.items()}
