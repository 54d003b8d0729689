"""`alpha-ckpt` run inside the test's own process: the same entry point and exit codes as the
console script, without an interpreter start and a torch import per call (seconds each here).
The console script itself is tested as a subprocess in tests/unit/test_verify_cli.py."""
import io
import subprocess

from alpha_ckpt import cli


def alpha_ckpt_cli(*args: str) -> subprocess.CompletedProcess:
    out, err = io.StringIO(), io.StringIO()
    code = cli.main([str(a) for a in args], out=out, err=err)
    return subprocess.CompletedProcess(["alpha-ckpt", *args], code, out.getvalue(), err.getvalue())
