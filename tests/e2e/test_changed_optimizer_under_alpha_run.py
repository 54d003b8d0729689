"""A script resumed under alpha-run with another optimizer class than the one it saved exits 3 (``coverage``):
the alpha-run door of the refusal tests/distributed/test_changed_optimizer.py checks at the others."""
import textwrap
from pathlib import Path

import pytest

from alpha_ckpt.testing import launch

TESTS = Path(__file__).resolve().parents[1]  # gpt_training.py, for the script alpha-run starts


SCRIPT = textwrap.dedent("""
    import sys
    import torch
    import alpha_ckpt
    from alpha_ckpt import Checkpointer
    sys.path.insert(0, sys.argv[2])
    from gpt_training import GPT, CONTEXT, VOCAB, optimizer_step


    def main():
        torch.manual_seed(0)
        model = GPT()
        optim = {"SGD": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                 "AdamW": lambda p: torch.optim.AdamW(p, lr=1e-3)}[sys.argv[1]](model.parameters())
        ckpt = Checkpointer.from_launcher_env(allow_nonfinite="*.causal_mask")
        state = {"model": model, "optim": optim}
        counters = ckpt.restore(state)
        update = counters.update if counters else 0
        optimizer_step(model, optim, torch.randint(0, VOCAB, (4, CONTEXT + 1)))
        ckpt.save(state, update=update + 1)
        ckpt.close()


    alpha_ckpt.run_resilient(main, backend="gloo")
""")


@pytest.mark.timeout(300)
def test_a_script_resumed_with_another_optimizer_class_exits_3_under_alpha_run(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)

    def alpha_run(optimizer, *flags):
        return launch.alpha_run("--nproc", "2", "--store", tmp_path / "s", *flags, script, optimizer, TESTS,
                                cwd=tmp_path, timeout=240)
    first = alpha_run("SGD")
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = alpha_run("AdamW", "--resume", "latest")
    assert resumed.returncode == 3, resumed.stderr[-3000:]
