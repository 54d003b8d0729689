"""The README's commands and example stay true."""
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
README = (ROOT / "README.md").read_text()


@pytest.mark.timeout(120)
def test_readme_python_example_runs(tmp_path):
    (code,) = re.findall(r"```python\n(.*?)```", README, re.S)
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr
    assert re.fullmatch(r"[0-9a-f]{64}\n", proc.stdout)


@pytest.mark.timeout(300)
def test_the_main_job_command_of_the_readme_runs_as_written(tmp_path):
    line = next(l for l in README.splitlines() if "alpha-run" in l and l.startswith("pip install"))
    job = shlex.split(line.split("&&", 1)[1].split("#", 1)[0])
    assert job[0] == "alpha-run"
    args = [a if a != "./alpha-store" else str(tmp_path / "store") for a in job[1:]]
    args = [a if a != "configs/forecast.toml" else str(ROOT / "configs" / "forecast.toml") for a in args]
    proc = subprocess.run([sys.executable, "-m", "alpha_ckpt.launcher", *args], capture_output=True, text=True,
                          timeout=280, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["update"] == 5 and result["owners"] == 4 and len(result["last_generation"]) == 64
    # Run again as written it exits 0 naming the same generation: tests/e2e/test_already_reached.py.


def _checkpoint_lines(path: Path, imports: tuple[str, ...]) -> int:
    """Imports, the lines between the "# --- checkpointing" and "# ---" markers, and the save line."""
    src = path.read_text().splitlines()
    start = next(i for i, line in enumerate(src) if line.strip().startswith("# --- checkpointing"))
    end = next(i for i in range(start + 1, len(src)) if src[i].strip() == "# ---")
    block = [line for line in src[start + 1:end] if line.strip()]
    return len(block) + sum("# --- and this one" in line for line in src) + sum(line.startswith(imports) for line in src)


def test_the_readme_counts_the_checkpoint_lines_of_both_example_scripts():
    ours = _checkpoint_lines(ROOT / "examples" / "train_gpt_ddp.py", ("import alpha_ckpt",))
    theirs = _checkpoint_lines(ROOT / "examples" / "train_gpt_ddp_dcp.py",
                               ("import torch.distributed.checkpoint", "from torch.distributed.checkpoint", "import os"))
    assert ours <= theirs
    assert f"Its checkpoint\ncode is {ours} lines" in README and f"needs {theirs}\n" in README
