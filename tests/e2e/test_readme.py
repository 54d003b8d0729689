"""The README's and docs' examples run, and their links resolve.

Every Python example is either a whole program, run here, or an excerpt of a script under
examples/ (the README's commands for it run here; those the e2e tests repeat, in the full set);
the README's Checkpointer example runs here inside a training script of its own. Nothing here
matches wording or line breaks.
"""
import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from alpha_ckpt.testing import launch

ROOT = Path(__file__).parents[2]
README = (ROOT / "README.md").read_text()
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
EXAMPLES = ROOT / "examples"


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def _code_lines(block: str) -> list[str]:
    """A block's lines without comments or indentation; `...` (the rest of a script) left out."""
    lines = [re.sub(r"\s+#.*$", "", line).strip() for line in block.splitlines()]
    return [line for line in lines if line and line != "..." and not line.startswith("#")]


def _example_lines() -> set[str]:
    return {line for path in EXAMPLES.glob("*.py") for line in _code_lines(path.read_text())}


def _is_checkpointer_example(block: str) -> bool:
    return "alpha_ckpt.Checkpointer" in block and "..." in block.splitlines()


def _python_examples() -> list[tuple[str, int, str]]:
    return [(path.name, i, block) for path in DOCS for i, block in enumerate(_blocks(path.read_text(), "python"))]


def _is_excerpt(block: str) -> bool:
    return set(_code_lines(block)) <= _example_lines()


def _alpha_run(args: list[str], cwd: Path, timeout: int):
    return launch.alpha_run(*args, cwd=cwd, timeout=timeout)


def _programs():
    return [pytest.param(block, id=f"{name}-{i}") for name, i, block in _python_examples()
            if not _is_checkpointer_example(block) and not _is_excerpt(block)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("code", _programs())
def test_every_whole_python_example_of_the_docs_runs(tmp_path, code):
    proc = launch.python_c(code, cwd=tmp_path, timeout=100)
    assert proc.returncode == 0, proc.stderr
    assert re.fullmatch(r"[0-9a-f]{64}\n", proc.stdout)  # the example prints the root it saved


def test_the_docs_have_python_examples_and_the_readme_opens_with_the_checkpointer_one():
    examples = _python_examples()
    assert any(name == "README.md" for name, _, _ in examples)
    assert _is_checkpointer_example(_blocks(README, "python")[0])
    assert _programs(), "at least one whole program is run above"


CHECKPOINTER_HARNESS = '''
import json, sys
import torch, torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
sys.path.insert(0, {examples!r})
import alpha_ckpt
from train_gpt_ddp import GPT, VOCAB, DataPosition, Tokens

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = DistributedDataParallel(GPT())
optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: min(1.0, (s + 1) / 4))
data = DataPosition(Tokens(), rank, world, batch=4)
progress = {{"step": 0}}
{example}
if rank == 0:
    print(json.dumps({{"step": progress["step"], "root": ckpt.last_save["root"]}}), flush=True)
ckpt.close()
dist.destroy_process_group()
'''

TRAIN_ONE_STEP = '''seq = next(data)
loss = nn.functional.cross_entropy(model(seq[:, :-1]).reshape(-1, VOCAB), seq[:, 1:].reshape(-1))
optim.zero_grad(); loss.backward(); optim.step(); sched.step()
progress["step"] += 1
step, samples_seen = progress["step"], progress["step"] * 4 * world'''


@pytest.mark.timeout(300)
def test_the_readme_checkpointer_example_saves_and_a_resumed_run_continues_from_it(tmp_path):
    block = _blocks(README, "python")[0]
    example = "\n".join(TRAIN_ONE_STEP if line.strip() == "..." else line for line in block.splitlines())
    script = tmp_path / "readme_example.py"
    script.write_text(CHECKPOINTER_HARNESS.format(examples=str(EXAMPLES), example=example))
    first = _alpha_run(["--nproc", "2", "--store", str(tmp_path / "ckpt"), str(script)], tmp_path, 240)
    assert first.returncode == 0, first.stderr[-3000:]
    saved = json.loads(first.stdout.strip().splitlines()[-1])
    assert saved["step"] == 1 and len(saved["root"]) == 64
    again = _alpha_run(["--nproc", "2", "--store", str(tmp_path / "ckpt"), "--resume", "latest", str(script)],
                       tmp_path, 240)
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads(again.stdout.strip().splitlines()[-1])["step"] == 2  # restored step 1, trained one more
    # Neither --resume nor --resume-from: "latest" as under torchrun, so the run goes on once more.
    third = _alpha_run(["--nproc", "2", "--store", str(tmp_path / "ckpt"), str(script)], tmp_path, 240)
    assert third.returncode == 0, third.stderr[-3000:]
    assert json.loads(third.stdout.strip().splitlines()[-1])["step"] == 3


def _readme_runs() -> list[list[list[str]]]:
    """The README's alpha-run command blocks (beside the set-up commands), each a list of commands."""
    runs = []
    for block in _blocks(README, "bash"):
        commands = [shlex.split(line.split("#", 1)[0]) for line in block.splitlines() if line.startswith("alpha-run ")]
        if commands and "s3://" not in block:  # the S3 block: test_the_readme_s3_commands_run_against_a_local_server
            runs.append(commands)
    return runs


# Scripts whose train-then-resume the e2e tests already run (tests/e2e/test_script.py,
# test_sharded_examples.py): here as written only in the full set.
RUN_BY_E2E = {"train_gpt_ddp", "train_fsdp2"}


def _readme_run_params():
    params = []
    for commands in _readme_runs():
        script = Path(next(a for a in commands[0] if a.endswith(".py"))).stem
        recovery = "--fail-at" in commands[0]  # the fast-recovery example: run in every set
        kind = ("-recovery" if recovery else "") + ("-in-place" if "--in-place" in commands[0] else "")
        params.append(pytest.param(commands, id=script + kind,
                                   marks=[pytest.mark.full] if script in RUN_BY_E2E and not recovery else []))
    return params


@pytest.mark.timeout(600)
@pytest.mark.parametrize("commands", _readme_run_params())
def test_the_readme_script_commands_run_as_written_and_resume(tmp_path, commands):
    for command in commands:
        assert command[0] == "alpha-run"
        args = [str(ROOT / a) if a.startswith("examples/") else a for a in command[1:]]
        proc = _alpha_run(args, tmp_path, 280)
        assert proc.returncode == 0, proc.stderr[-3000:]
        steps = int(command[command.index("--steps") + 1])
        assert json.loads(proc.stdout.strip().splitlines()[-1])["step"] == steps


@pytest.mark.timeout(300)
def test_the_main_job_command_of_the_readme_runs_as_written(tmp_path):
    line = next(l for l in README.splitlines() if "alpha-run" in l and l.startswith("pip install"))
    job = shlex.split(line.split("&&", 1)[1].split("#", 1)[0])
    assert job[0] == "alpha-run"
    args = [a if a != "./alpha-store" else str(tmp_path / "store") for a in job[1:]]
    args = [a if a != "configs/forecast.toml" else str(ROOT / "configs" / "forecast.toml") for a in args]
    proc = _alpha_run(args, tmp_path, 280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["update"] == 5 and result["owners"] == 4 and len(result["last_generation"]) == 64
    # Run again as written it exits 0 naming the same generation: tests/e2e/test_already_reached.py.


def test_the_readme_test_command_is_the_one_ci_runs():
    line = next(l for l in README.splitlines() if "pytest" in l and l.startswith("pip install"))
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert line.split("#", 1)[0].strip() in [c.strip() for c in ci]


def _checkpoint_lines(path: Path, imports: tuple[str, ...]) -> int:
    """Imports, the lines between the "# --- checkpointing" and "# ---" markers, and the save line."""
    src = path.read_text().splitlines()
    start = next(i for i, line in enumerate(src) if line.strip().startswith("# --- checkpointing"))
    end = next(i for i in range(start + 1, len(src)) if src[i].strip() == "# ---")
    block = [line for line in src[start + 1:end] if line.strip()]
    return len(block) + sum("# --- and this one" in line for line in src) + sum(line.startswith(imports) for line in src)


def test_the_line_counts_the_readme_states_are_those_of_the_two_example_scripts():
    ours = _checkpoint_lines(EXAMPLES / "train_gpt_ddp.py", ("import alpha_ckpt",))
    theirs = _checkpoint_lines(EXAMPLES / "train_gpt_ddp_dcp.py",
                               ("import torch.distributed.checkpoint", "from torch.distributed.checkpoint", "import os"))
    assert ours <= theirs
    prose = " ".join(README.split())  # the numbers stated, wherever the lines break
    stated = {int(a or b) for a, b in re.findall(r"\b(\d+) lines\b|\bneeds (\d+)\b", prose)}
    assert {ours, theirs} <= stated


def test_every_refusal_code_is_documented_in_the_readme():
    from alpha_ckpt.errors import RefusalCode
    missing = [c.value for c in RefusalCode if f"`{c.value}`" not in README]
    assert not missing


def _relative_links(text: str) -> list[str]:
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    return [t for t in targets if not re.match(r"[a-z]+:", t) and not t.startswith("#")]


def _anchors(path: Path) -> set[str]:
    """The heading anchors GitHub makes of a Markdown file (outside code blocks)."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in re.findall(r"^#+ (.+)$", text, re.M)}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_relative_link_of_the_readme_and_docs_points_to_an_existing_file_and_heading(doc):
    broken = []
    for link in _relative_links(doc.read_text()) + [f"{doc.name}{a}" for a in re.findall(r"\]\((#[^)\s]+)\)",
                                                                                        doc.read_text())]:
        target, _, anchor = link.partition("#")
        path = doc.parent / target
        if not path.exists() or (anchor and path.suffix == ".md" and anchor not in _anchors(path)):
            broken.append(link)
    assert not broken, f"{doc.name}: {broken}"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_readme_s3_commands_run_against_a_local_server(tmp_path, s3_server, monkeypatch):
    block = next(b for b in _blocks(README, "bash") if "s3://" in b)
    lines = [line.split("#", 1)[0].strip() for line in block.splitlines()]
    env_line = next(line for line in lines if line.startswith("export AWS_ENDPOINT_URL="))
    assert {"AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"} == \
        {word.split("=", 1)[0] for word in shlex.split(env_line)[1:]}
    for name, value in s3_server.environment().items():  # the server's port, not 8333
        monkeypatch.setenv(name, value)
    make_bucket = next(line for line in lines if line.startswith("python -c"))
    made = subprocess.run(shlex.split(make_bucket), capture_output=True, text=True, timeout=60)
    assert made.returncode == 0 or "BucketAlreadyOwnedByYou" in made.stderr, made.stderr
    job = shlex.split(next(line for line in lines if line.startswith("alpha-run ")))
    args = [a if a != "configs/forecast.toml" else str(ROOT / "configs" / "forecast.toml") for a in job[1:]]
    proc = _alpha_run(args, tmp_path, 280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["update"] == 5 and result["output"].startswith("s3://ckpt/forecast/outputs/")
