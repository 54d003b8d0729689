"""A short bounded run of tests/fuzz_readers.py's targets (the long run is that file run as a script)."""
import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "fuzz_readers.py"


@pytest.mark.timeout(240)
def test_the_readers_only_refuse_and_never_accept_a_damaged_object(capsys):
    spec = importlib.util.spec_from_file_location("fuzz_readers", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.run(seconds_per_target=0, max_examples=150) == 0, capsys.readouterr().out
