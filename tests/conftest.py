"""Shared pytest helpers: run a worker script on N ranks under cringrun with a
hard timeout, so a hang fails the test instead of blocking the suite; ports
that no other test process on the machine is handed at the same time; the
GPU test doubles (`fakes`, built once per session; tests/fake_gpu.py) with
their seed in the header and in every failed test's report; the suite's
markers and xdist groups, given by module (docs/testing.md); and, under
CI=true, a skip is a failure (a missing tool or permission must not hide an
area)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Optional

import fake_gpu
import pytest

from ports import free_port  # noqa: F401  (re-exported: `from conftest import free_port`)

WORKERS = Path(__file__).parent / "workers"
DEFAULT_TIMEOUT_S = 240


# -------------------------------------------------------------------------------------- workers


def run_ranks(
    np_: int,
    script: str,
    *args: str,
    env: Optional[dict] = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    check: bool = True,
) -> subprocess.CompletedProcess:
    """Run tests/workers/<script> on np_ ranks through `python -m cring.run`."""
    full_env = dict(os.environ)
    full_env.setdefault("CRING_TIMEOUT_SECONDS", "60")
    if env:
        full_env.update(env)
    cmd = [
        sys.executable,
        "-m",
        "cring.run",
        "-np",
        str(np_),
        sys.executable,
        str(WORKERS / script),
        *args,
    ]
    try:
        proc = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(
            f"{script} on {np_} ranks hung for {timeout} s\nstdout:\n{e.stdout}\n"
            f"stderr:\n{e.stderr}"
        )
    if check and proc.returncode != 0:
        pytest.fail(
            f"{script} on {np_} ranks exited {proc.returncode}\nstdout:\n"
            f"{proc.stdout[-6000:]}\nstderr:\n{proc.stderr[-6000:]}"
        )
    return proc


def rank_results(tmp_path: Path, np_: int) -> list[dict]:
    """The JSON each rank wrote to <tmp_path>/rank<R>.json."""
    out = []
    for r in range(np_):
        with open(tmp_path / f"rank{r}.json") as f:
            out.append(json.load(f))
    return out


# ------------------------------------------------------------------------- the GPU test doubles


@pytest.fixture(scope="session")
def fakes(tmp_path_factory) -> fake_gpu.FakeGPU:
    """libfake_nccl.so, libfake_nccl_no_allgather.so and libfake_cudart.so
    (csrc/tests/fake_*.c), compiled once per session: fakes["nccl"] etc. are
    their paths, fakes.env(**extra) an environment for a process on them
    (seeded as the session is)."""
    try:
        return fake_gpu.FakeGPU(fake_gpu.build(tmp_path_factory.mktemp("fakes")))
    except RuntimeError as e:
        pytest.skip(str(e))


def pytest_report_header(config) -> str:
    return fake_gpu.FakeGPU().describe()


# ------------------------------------------------------------------------------------ signals


def pytest_configure(config: pytest.Config) -> None:
    """Undo ignored SIGINT, SIGTERM and SIGHUP in this process, so that every
    process a test starts begins with them at their defaults. A runner that
    starts the suite as a background job of a non-interactive shell (SIGINT
    ignored) or under nohup (SIGHUP ignored) passes that on to every child; a
    cringrun started so keeps ignoring it, as a launcher should, and the tests
    that send it Ctrl-C then wait for nothing (the simulated-host Ctrl-C test
    hung for its 300 s twice that way)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(signum) is signal.SIG_IGN:
            default = signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL
            signal.signal(signum, default)


# --------------------------------------------------------------------------- markers and groups

# Area markers by module (registered in pyproject.toml; docs/testing.md). A
# module named nowhere here carries none: new modules are fast by default, and
# a heavy one is marked `slow` where it is written (pytestmark or a decorator).
AREAS = {
    "ray": (
        "test_ray",
        "test_ray_data_tune",
        "test_ray_elastic",
        "test_ray_executor",
        "test_ray_serve",
    ),
    "lightning": (
        "test_lightning",
        "test_lightning_amp",
        "test_lightning_cuda",
        "test_lightning_hooks",
        "test_lightning_save_after_fit",
    ),
    "fakegpu": (
        "test_check_build",
        "test_gpu_buckets",
        "test_gpu_comms",
        "test_gpu_engine",
        "test_gpu_loader",
        "test_gpu_ordering",
        "test_gpu_results",
        "test_gpu_sweep",
        "test_lightning_cuda",
    ),
    "multihost": ("test_launcher_hosts", "test_multihost"),
}
# Tests that use one of these fixtures (in these modules) are slow: the fixture
# starts the Ray tests' shared cluster, or every Lightning scenario at once.
SLOW_FIXTURES = {
    "cluster": AREAS["ray"],
    "runs": ("test_lightning", "test_lightning_amp"),
}
# Modules marked `slow` as a whole here rather than in the file, because
# another issue owns the file this round (the fake-GPU model-scale replays and
# sweep). Elsewhere a slow test is marked where it is written.
SLOW_MODULES = ("test_gpu_buckets", "test_gpu_sweep")
# pytest-xdist (--dist loadgroup) groups: every test of a group runs on one
# worker, in collection order. The Ray modules share one Ray cluster per worker
# (ray_cluster.py). Any other module with a module- or class-scoped fixture
# (one job whose results many tests read) is a group of its own, so that the
# job runs once; the rest are spread one test at a time.
GROUPS = {module: "ray" for module in AREAS["ray"]}
# Groups handed out first (longest first), so that no long group starts last
# and leaves the other worker idle at the end.
FIRST = ("ray", "test_lightning", "test_launcher_hosts", "test_zero", "test_torch_optimizer")


def _module(item: pytest.Item) -> str:
    return Path(str(item.fspath)).stem


def _uses_a_shared_fixture(item: pytest.Item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    return any(
        d.scope in ("module", "class", "package")
        for defs in info.name2fixturedefs.values()
        for d in defs
    )


@pytest.hookimpl(tryfirst=True)  # before -m deselects and xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    grouped_modules = {_module(i) for i in items if _uses_a_shared_fixture(i)}
    for item in items:
        module = _module(item)
        for area, modules in AREAS.items():
            if module in modules:
                item.add_marker(getattr(pytest.mark, area))
        fixtures = getattr(item, "fixturenames", ())
        if module in SLOW_MODULES or any(
            name in fixtures and module in modules for name, modules in SLOW_FIXTURES.items()
        ):
            item.add_marker(pytest.mark.slow)
        group = GROUPS.get(module) or (module if module in grouped_modules else None)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))

    def order(item: pytest.Item) -> tuple:
        groups = [m.args[0] for m in item.iter_markers("xdist_group")]
        first = FIRST.index(groups[0]) if groups and groups[0] in FIRST else len(FIRST)
        return first, RAY_ORDER.get(_module(item), 0)

    items.sort(key=order)  # stable: each module's tests keep their order


# The Ray modules' order within their group: the Serve example (which starts a
# Ray instance of its own) before the shared cluster starts, and test_ray, whose
# last test stops the shared cluster, at the end.
RAY_ORDER = {"test_ray_serve": -1, "test_ray": 1}


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: Optional[pytest.Item]) -> None:
    """After the last Ray test of this process (the next test is no Ray test,
    or there is none), stop the shared Ray cluster if it still runs, and fail
    this teardown if any of its processes is left."""
    if nextitem is not None and _module(nextitem) in AREAS["ray"]:
        return
    ray_cluster = sys.modules.get("ray_cluster")
    if ray_cluster is None or ray_cluster.running() is None:
        return
    left = ray_cluster.stop_shared()
    assert not left, f"Ray processes left after ray.shutdown(): {left}"


# ---------------------------------------------------------------------------- no skips under CI


def _ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def _skip_reason(longrepr) -> str:
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])
    return str(longrepr)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """Under CI=true a skipped test fails, with the skip's reason: CI installs
    everything the suite needs (scripts/test.sh), so a skip there means a tool,
    package or permission went missing and an area went untested unnoticed. A
    failed test that used the GPU test doubles reports their seed."""
    report = yield
    if _ci() and report.skipped and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        report.longrepr = (
            f"skipped under CI=true, where no test may skip: {_skip_reason(report.longrepr)}"
        )
    if report.failed and "fakes" in getattr(item, "fixturenames", ()):
        report.sections.append(("fake GPU", fake_gpu.FakeGPU().describe()))
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    """The same for a whole module skipped at import (importorskip, a
    module-level pytest.skip)."""
    report = yield
    if _ci() and report.skipped:
        report.outcome = "failed"
        report.longrepr = (
            f"skipped under CI=true, where no test may skip: {_skip_reason(report.longrepr)}"
        )
    return report
