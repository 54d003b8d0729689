"""Code says why; measurements live in docs/BENCHMARKS.md, where they are dated and can be redone."""
import io
import re
import tokenize
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "alpha_ckpt"
RATIO = re.compile(r"\b\d+(\.\d+)?x\b")  # 1.14x, 0.8x: a measurement that goes stale where no one redoes it


def _comments_and_docstrings(path: Path):
    source = path.read_text()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT or (token.type == tokenize.STRING and token.string.startswith(('"""', "'''"))):
            yield token.start[0], token.string


def test_no_comment_or_docstring_in_the_package_quotes_a_benchmark_ratio():
    quoted = [f"{path.relative_to(PACKAGE.parent)}:{line}: {text.strip()[:80]}"
              for path in sorted(PACKAGE.rglob("*.py")) for line, text in _comments_and_docstrings(path)
              if RATIO.search(text)]
    assert quoted == []
