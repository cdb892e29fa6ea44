"""The suite's own rules (tests/conftest.py, docs/testing.md), on a scratch
copy of conftest with stand-in test modules run by a child pytest: under
CI=true a skip of any kind fails with its reason (an xfail stays an xfail);
without CI it stays a skip; the area and slow markers land by module and
fixture, so `-m "not slow"` leaves those tests out; a suite started with
SIGINT ignored (a background job) starts its tests' processes with SIGINT
at its default."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

HERE = Path(__file__).parent

SKIPPING = """
import pytest

@pytest.mark.skipif(True, reason="a tool is missing")
def test_skipif():
    pass

def test_skip_call():
    pytest.skip("no permission here")

@pytest.mark.xfail(reason="known", strict=True)
def test_xfail():
    assert False

def test_passes():
    pass
"""

IMPORT_SKIP = """
import pytest
pytest.importorskip("a_module_nobody_installs")

def test_never_collected():
    pass
"""


def _scratch(tmp_path: Path, modules: dict[str, str]) -> Path:
    for helper in ("conftest.py", "ports.py", "fake_gpu.py"):
        shutil.copy(HERE / helper, tmp_path / helper)
    for name, source in modules.items():
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    return tmp_path


SIGNALS = """
import subprocess

def test_a_child_starts_with_sigint_at_its_default():
    status = subprocess.run(
        ["grep", "SigIgn", "/proc/self/status"], capture_output=True, text=True
    ).stdout
    assert not int(status.split()[1], 16) & (1 << 1), status  # SIGINT is signal 2
"""

# pytest started as a background job of a non-interactive shell would be: SIGINT ignored
IGNORING_SIGINT = [
    "-c",
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])",
]


def _pytest(
    where: Path, *args: str, ci: bool, sigint_ignored: bool = False
) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci:
        env["CI"] = "true"
    shim = IGNORING_SIGINT if sigint_ignored else []
    return subprocess.run(
        [
            sys.executable,
            *shim,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-rA",
            "-p",
            "no:xdist",
            *args,
        ],
        cwd=where,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_under_ci_every_skip_fails_with_its_reason(tmp_path):
    where = _scratch(tmp_path, {"test_skipping": SKIPPING, "test_import_skip": IMPORT_SKIP})
    proc = _pytest(where, "test_skipping.py", ci=True)
    out = proc.stdout
    assert proc.returncode == 1, out
    assert "skipped under CI=true, where no test may skip: Skipped: a tool is missing" in out
    assert "skipped under CI=true, where no test may skip: Skipped: no permission here" in out
    assert "XFAIL test_skipping.py::test_xfail" in out  # an expected failure is not a skip
    assert "PASSED test_skipping.py::test_passes" in out
    assert " skipped" not in out.splitlines()[-1], out.splitlines()[-1]
    # a module skipped at import is a collection error (pytest stops there, as
    # for any collection error; under xdist the other modules still run)
    proc = _pytest(where, "test_import_skip.py", ci=True)
    assert proc.returncode != 0, proc.stdout
    assert "ERROR test_import_skip.py - skipped under CI=true" in proc.stdout, proc.stdout
    assert "could not import 'a_module_nobody_installs'" in proc.stdout


def test_without_ci_a_skip_stays_a_skip(tmp_path):
    where = _scratch(tmp_path, {"test_skipping": SKIPPING})
    proc = _pytest(where, "test_skipping.py", ci=False)
    assert proc.returncode == 0, proc.stdout
    assert "2 skipped" in proc.stdout.splitlines()[-1], proc.stdout


def test_markers_land_by_module_and_fixture(tmp_path):
    where = _scratch(
        tmp_path,
        {
            "test_gpu_sweep": "def test_sweep():\n    pass\n",  # slow and fakegpu, by module
            "test_lightning": """
                import pytest

                @pytest.fixture(scope="module")
                def runs():
                    return 1

                def test_reads_the_job(runs):
                    pass

                def test_quick():
                    pass
            """,
            "test_new_module": "def test_new():\n    pass\n",  # unnamed: fast, unmarked
        },
    )
    proc = _pytest(where, "--collect-only", "-q", "-m", "not slow", ci=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    collected = {line for line in proc.stdout.splitlines() if "::" in line}
    assert collected == {"test_lightning.py::test_quick", "test_new_module.py::test_new"}, collected
    proc = _pytest(where, "--collect-only", "-q", "-m", "fakegpu or lightning", ci=False)
    collected = {line for line in proc.stdout.splitlines() if "::" in line}
    assert collected == {
        "test_gpu_sweep.py::test_sweep",
        "test_lightning.py::test_reads_the_job",
        "test_lightning.py::test_quick",
    }, collected


def test_a_suite_started_with_sigint_ignored_gives_its_tests_the_default(tmp_path):
    where = _scratch(tmp_path, {"test_signals": SIGNALS})
    proc = _pytest(where, "test_signals.py", ci=False, sigint_ignored=True)
    assert proc.returncode == 0, proc.stdout
