"""`cringrun --check-build` (also `-cb` and `python -m cring.info`) on a
machine without a GPU (issue 28): the report with nothing found (no framework,
no NCCL, no CUDA runtime), with the test doubles libfake_nccl.so and
libfake_cudart.so (csrc/tests/fake_*.c) found through CRING_NCCL_LIBRARY and
CRING_CUDART_LIBRARY (path, version, GPUs seen, and a WARNING line exactly for
the NCCL versions with a known defect, chosen through CRING_FAKE_NCCL_VERSION),
the frameworks of this Python with their versions (without importing them),
the kernels the C core picked, and the knobs (CRING_* and mapped HOROVOD_*).
Every process has a hard timeout.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest

import cring  # the cring under test: installed, or the tree's with its _C built in place

ROOT = Path(__file__).resolve().parent.parent
CRING_PACKAGE = Path(cring.__file__).resolve().parent
PYTHON_DIR = CRING_PACKAGE.parent
TIMEOUT_S = 120


def clean_env(**extra: str) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("CRING_", "HOROVOD_")) and k != "PYTHONPATH"
    }
    env["PYTHONPATH"] = str(PYTHON_DIR)
    env.update(extra)
    return env


def check_build(env: dict, *args: str, python_flags: tuple = ()) -> str:
    cmd = [sys.executable, *python_flags, "-m", "cring.run", *(args or ("--check-build",))]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"hung for {TIMEOUT_S} s\nstdout:\n{e.stdout}\nstderr:\n{e.stderr}")
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def section(report: str, title: str) -> list:
    """The indented lines under the heading that starts with `title`."""
    lines = report.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title))
    out = []
    for line in lines[start + 1 :]:
        if not line.startswith("    "):
            break
        out.append(line.strip())
    return out


def missing(tmp_path: Path) -> dict:
    """Library overrides that cannot load: nothing else is tried (so a CUDA
    runtime installed on this machine stays out of the way)."""
    return {
        "CRING_NCCL_LIBRARY": str(tmp_path / "no" / "libnccl.so.2"),
        "CRING_CUDART_LIBRARY": str(tmp_path / "no" / "libcudart.so"),
    }


def cring_and_numpy_only(tmp_path: Path) -> Path:
    """A directory holding only cring and numpy (links to the ones this Python
    imports), for a Python run without site: no torch, Lightning or Ray to
    find, wherever cring is installed (a venv's site-packages holds them all)."""
    import numpy

    site = Path(numpy.__file__).resolve().parent.parent
    only = tmp_path / "cring-and-numpy"
    only.mkdir()
    for entry in site.iterdir():
        if entry.name == "numpy" or entry.name.startswith(("numpy-", "numpy.libs")):
            (only / entry.name).symlink_to(entry)
    (only / "cring").symlink_to(CRING_PACKAGE)
    return only


def test_nothing_found(tmp_path):
    env = clean_env(**missing(tmp_path))
    only = cring_and_numpy_only(tmp_path)
    env["PYTHONPATH"] = str(only)
    report = check_build(env, python_flags=("-S",))
    assert report.startswith(f"cring {cring.__version__}\n")
    assert f"installed at: {only / 'cring'}" in report
    assert section(report, "Frameworks") == [
        "[ ] torch (not installed; for cring.torch: pip install 'cring[torch]')",
        "[ ] Lightning (not installed; for cring.lightning: pip install 'cring[lightning]')",
        "[ ] Ray (not installed; for cring.ray: pip install 'cring[ray]')",
    ]
    gpu = section(report, "GPU")
    assert gpu[0].startswith("[ ] NCCL: ") and env["CRING_NCCL_LIBRARY"] in gpu[0], gpu
    assert gpu[1].startswith("[ ] CUDA runtime: ") and env["CRING_CUDART_LIBRARY"] in gpu[1], gpu
    assert section(report, "Known defects") == ["none"]
    # the overrides are the only knobs set
    assert section(report, "Knobs") == [
        f"CRING_CUDART_LIBRARY={env['CRING_CUDART_LIBRARY']}  (environment)",
        f"CRING_NCCL_LIBRARY={env['CRING_NCCL_LIBRARY']}  (environment)",
    ]
    transports = section(report, "Transports")
    assert transports[1].startswith("[X] tcp"), transports
    assert [t.split()[1] for t in transports] == ["shm", "tcp", "hierarchical"]


def test_horovod_spelling_and_python_m_cring_info_print_the_same(tmp_path):
    env = clean_env(**missing(tmp_path))
    long = check_build(env, "--check-build")
    assert check_build(env, "-cb") == long
    proc = subprocess.run(
        [sys.executable, "-m", "cring.info"],
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert proc.returncode == 0 and proc.stdout == long


@pytest.mark.parametrize(
    "code, text, affected",
    [
        (22809, "2.28.9", True),
        (22700, "2.27.0", True),  # the first affected release
        (22906, "2.29.6", True),  # the last one
        (22907, "2.29.7", False),  # fixed
        (22611, "2.26.11", False),
    ],
)
def test_fake_nccl_and_cudart_are_reported_with_their_defects(fakes, code, text, affected):
    env = clean_env(
        CRING_NCCL_LIBRARY=fakes["nccl"],
        CRING_CUDART_LIBRARY=fakes["cudart"],
        CRING_FAKE_NCCL_VERSION=str(code),
        CRING_FAKE_CUDA_DEVICES="2",
    )
    report = check_build(env)
    gpu = section(report, "GPU")
    assert gpu[0] == f"[X] NCCL {text}: {fakes['nccl']}"
    assert gpu[1] == f"[X] CUDA runtime 12.8: {fakes['cudart']}; 2 GPUs seen"  # the fake's 12080
    defects = section(report, "Known defects")
    warnings = [line for line in report.splitlines() if "WARNING" in line]
    if affected:
        assert len(defects) == 1 and defects[0].startswith(f"WARNING: NCCL {text} "), defects
        assert "Average" in defects[0] and "PreMulSum" in defects[0] and "2.29.7" in defects[0]
        assert warnings == [f"    {defects[0]}"]
    else:
        assert defects == ["none"] and warnings == []


def test_a_cuda_runtime_without_a_gpu(fakes):
    env = clean_env(
        CRING_NCCL_LIBRARY=fakes["nccl"],
        CRING_CUDART_LIBRARY=fakes["cudart"],
        CRING_FAKE_CUDA_DEVICES="0",
    )
    gpu = section(check_build(env), "GPU")
    assert gpu[1] == f"[ ] CUDA runtime 12.8: {fakes['cudart']}; no GPU seen"


def test_known_defects_reads_both_nccl_version_conventions():
    from cring.info import known_defects

    assert len(known_defects(22809)) == 1
    assert known_defects(22907) == [] and known_defects(None) == []
    assert known_defects(2708) == []  # NCCL 2.7.8 in the convention before 2.9


def test_frameworks_with_their_versions_without_importing_them(tmp_path):
    env = clean_env(**missing(tmp_path))
    code = (
        "import sys, cring.info; print(cring.info.report()); "
        "print('imported:', sorted({'torch', 'lightning', 'pytorch_lightning', 'ray'} "
        "& set(sys.modules)))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.rstrip().endswith("imported: []")
    frameworks = section(proc.stdout, "Frameworks")
    for line, dist in zip(frameworks, ("torch", "lightning", "ray")):
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            assert line.startswith("[ ] "), line
            continue
        assert line.startswith(f"[X] {line.split()[1]} {version} ("), line


def test_kernels_and_knobs(tmp_path):
    secret = "do-not-print-me-0123456789"
    env = clean_env(
        **missing(tmp_path),
        CRING_REDUCE_ISA="scalar",
        CRING_SECRET=secret,
        CRING_FUSION_THRESHOLD="1048576",
        HOROVOD_FUSION_THRESHOLD="4096",
        HOROVOD_CYCLE_TIME="3.5",
        HOROVOD_GPU_OPERATIONS="MPI",
        HOROVOD_HIERARCHICAL_ALLREDUCE="1",
        HOROVOD_LOG_LEVEL="chatty",
        HOROVOD_RANK="0",
    )
    report = check_build(env)
    assert secret not in report
    assert section(report, "Reduction kernels") == [
        "scalar (picked for this CPU at run time, capped by CRING_REDUCE_ISA=scalar)"
    ]
    knobs = section(report, "Knobs")
    for line in (
        "CRING_FUSION_THRESHOLD=1048576  (environment)",
        "CRING_REDUCE_ISA=scalar  (environment)",
        "CRING_SECRET=(set, not shown)  (environment)",
        "CRING_CYCLE_TIME=3.5  (from HOROVOD_CYCLE_TIME=3.5)",
        "HOROVOD_FUSION_THRESHOLD=4096  (ignored: CRING_FUSION_THRESHOLD is set)",
        "CRING_GPU_OPERATIONS=host  (from HOROVOD_GPU_OPERATIONS=MPI)",
        "HOROVOD_HIERARCHICAL_ALLREDUCE=1  (ignored: no cring equivalent)",
        "HOROVOD_LOG_LEVEL=chatty  (ignored: value not understood)",
    ):
        assert line in knobs, (line, knobs)
    assert not any(k.startswith("HOROVOD_RANK") for k in knobs)  # read by rank discovery


def test_check_build_needs_no_command_and_version_is_one_place(tmp_path):
    env = clean_env(**missing(tmp_path))
    assert check_build(env, "--version").strip() == f"cringrun (cring) {cring.__version__}"
    assert check_build(env, "-v") == check_build(env, "--version")
    text = (ROOT / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in text and 'attr = "cring._version.__version__"' in text


def _cache_bytes(level: int) -> int:
    """cpu0's data or unified cache of `level` from sysfs (0: none reported)."""
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            if int((index / "level").read_text()) != level:
                continue
            if (index / "type").read_text().startswith("Instruction"):
                continue
            text = (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        return int(text.rstrip("KMG")) * scale
    return 0


def test_shared_memory_sizes_from_the_caches_and_the_knobs(tmp_path):
    """Issue 35: the shared-memory collectives' sizes, derived from the caches
    the machine reports, are printed with the rule and the knob, and a knob
    that is set wins and says so."""
    report = check_build(clean_env(**missing(tmp_path)))
    lines = section(report, "Shared-memory sizes")
    l2 = _cache_bytes(2)
    assert lines[0].startswith("caches: L1d "), lines
    if l2 and l2 & (l2 - 1) == 0 and (256 << 10) <= l2 <= (1 << 30):
        quarter = min(max(l2 // 4, 64 << 10), 1 << 20)
        want = f"{quarter >> 10} KiB" if quarter < (1 << 20) else f"{quarter >> 20} MiB"
        assert f"rounds:{' ' * 10}" in lines[1] and want in lines[1], (want, lines)
        assert "(L2 / 4; CRING_SHM_ROUND_BYTES)" in lines[1], lines
    for knob in ("CRING_SHM_SMALL_BYTES", "CRING_SHM_STREAM_MIN_BYTES"):
        assert any(knob in line for line in lines), (knob, lines)
    env = clean_env(**missing(tmp_path), CRING_SHM_ROUND_BYTES="131072")
    lines = section(check_build(env), "Shared-memory sizes")
    assert any(
        line.startswith("rounds:") and "128 KiB  (CRING_SHM_ROUND_BYTES is set)" in line
        for line in lines
    ), lines


def test_result_cache_line_and_its_knob(tmp_path):
    """Issue 35: where large CPU results come from and how much freed memory
    cring keeps for them is printed with the knob; a value that is set says
    so, and 0 says the cache is off."""
    lines = section(check_build(clean_env(**missing(tmp_path))), "Result memory")
    assert lines[0] == "results of 1 MiB or more: blocks reused from a cache of freed ones", lines
    assert lines[1].startswith("kept at most:") and lines[1].endswith(
        "256 MiB  (default; CRING_RESULT_CACHE_BYTES)"
    ), lines
    env = clean_env(**missing(tmp_path), CRING_RESULT_CACHE_BYTES=str(64 << 20))
    lines = section(check_build(env), "Result memory")
    assert lines[1].endswith("64 MiB  (CRING_RESULT_CACHE_BYTES is set)"), lines
    env = clean_env(**missing(tmp_path), CRING_RESULT_CACHE_BYTES="0")
    lines = section(check_build(env), "Result memory")
    assert lines[0].startswith("off (CRING_RESULT_CACHE_BYTES is set)"), lines
