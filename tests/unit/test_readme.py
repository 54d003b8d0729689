"""The README's commands and example stay true."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = (Path(__file__).parents[2] / "README.md").read_text()
CONFIG = Path(__file__).parents[2] / "configs" / "demo.toml"


@pytest.mark.timeout(120)
def test_readme_python_example_runs(tmp_path):
    (code,) = re.findall(r"```python\n(.*?)```", README, re.S)
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr
    assert re.fullmatch(r"[0-9a-f]{64}\n", proc.stdout)


@pytest.mark.timeout(120)
def test_main_job_saves_lists_verifies_and_restores_bit_exactly(tmp_path):
    assert "alpha-run --store ./alpha-store configs/demo.toml" in README
    proc = subprocess.run([sys.executable, "-m", "alpha_ckpt.demo", "--store", str(tmp_path / "s"), str(CONFIG)],
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["restored_bit_exact"] is True and result["update"] == 3
    assert f"valid {result['root']}" in proc.stderr
