# The tree is formatted by tools (STYLE.md 8): ruff's lint rules and formatter
# over the Python, clang-format over the C. Each check skips, saying why, when
# its tool is missing or is another version than the one the tree was formatted
# with (formatters change their output between versions); scripts/test.sh
# installs both at these versions, and under CI=true such a skip fails
# (tests/conftest.py).
import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PYTHON_DIRS = ["python", "tests", "benchmarks", "scripts"]
RUFF_VERSION = "0.17.6"  # as pinned in scripts/test.sh
CLANG_FORMAT_MAJOR = 14  # Debian bookworm's clang-format, as scripts/test.sh installs it


def _ruff() -> list:
    if importlib.util.find_spec("ruff") is not None:
        command = [sys.executable, "-m", "ruff"]
    elif shutil.which("ruff"):
        command = [shutil.which("ruff")]
    else:
        pytest.skip(f"ruff is not installed (pip install ruff=={RUFF_VERSION})")
    version = subprocess.run(
        [*command, "--version"], capture_output=True, text=True, timeout=60
    ).stdout.split()
    if version[-1:] != [RUFF_VERSION]:
        pytest.skip(f"ruff {' '.join(version[1:])} is not the pinned {RUFF_VERSION}")
    return command


def _run(command: list) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_ruff_check():
    result = _run([*_ruff(), "check", "--no-cache", *PYTHON_DIRS])
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format():
    result = _run([*_ruff(), "format", "--check", "--no-cache", *PYTHON_DIRS])
    assert result.returncode == 0, result.stdout + result.stderr


def _clang_format() -> str:
    """clang-format-14 (Debian's versioned name) or a clang-format of that major."""
    found = []
    for name in (f"clang-format-{CLANG_FORMAT_MAJOR}", "clang-format"):
        tool = shutil.which(name)
        if tool is None:
            continue
        version = _run([tool, "--version"]).stdout
        major = re.search(r"version (\d+)\.", version)
        if major is not None and int(major.group(1)) == CLANG_FORMAT_MAJOR:
            return tool
        found.append(version.strip())
    if not found:
        pytest.skip(
            f"clang-format is not installed (apt-get install clang-format-{CLANG_FORMAT_MAJOR})"
        )
    pytest.skip(f"{'; '.join(found)}: not clang-format {CLANG_FORMAT_MAJOR}")


def test_clang_format():
    tool = _clang_format()
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").rglob("*.[ch]"))
    files += sorted(str(p.relative_to(ROOT)) for p in (ROOT / "benchmarks").glob("*.c"))
    assert len(files) > 50, files  # the source tree, not an installed copy
    result = _run([tool, "--dry-run", "--Werror", *files])
    assert result.returncode == 0, result.stderr[-4000:]
