"""The Horovod drop-in pieces of cring.torch on 2 and 3 real ranks
(tests/workers/hvd_parity.py): sparse_allreduce_async equals the dense
allreduce (a rank with no entries too), DistributedOptimizer trains a sparse
embedding (gathered, or sparse_as_dense) exactly as a dense one,
broadcast_optimizer_state on a fresh optimizer gives trainable parameters
zero gradients without moving them, _parameter_names, and join() followed by
a broadcast from the rank it returns leaves every rank with the same weights.
The import-error message without torch is checked in a subprocess."""

import json
import subprocess
import sys

import pytest

from conftest import rank_results, run_ranks

pytest.importorskip("torch")


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def results(request, tmp_path_factory):
    np_ = request.param
    tmp = tmp_path_factory.mktemp(f"parity{np_}")
    run_ranks(np_, "hvd_parity.py", str(tmp), timeout=240)
    return rank_results(tmp, np_)


def test_sparse_allreduce_async_equals_dense(results):
    for res in results:
        assert res["sparse_errors"] == pytest.approx([0, 0, 0], abs=1e-6)
        assert res["sparse_is_sparse"] == [True, True, True]
        assert "Average or Sum" in res["max_error"]


def test_sparse_gradients_train_like_dense(results):
    for res in results:
        assert res["sparse_gathered_err"] <= 1e-6
        assert res["sparse_as_dense_err"] <= 1e-6
        assert res["dense_weights"] == results[0]["dense_weights"]


def test_broadcast_optimizer_state_without_gradients(results):
    for res in results:
        assert res["no_grad_a_grad_is_none"]
        assert res["no_grad_b_grad"] == [0.0, 0.0, 0.0, 0.0]
        assert res["no_grad_b_unmoved"]


def test_parameter_names(results):
    for res in results:
        assert res["noname"] == ["noname.0.0", "noname.0.1", "noname.1.0", "noname.1.1"]
        assert res["noname_keys_are_params"]
        assert res["named"] == ["0.bias", "0.weight", "1.bias", "1.weight"]


def test_join_then_broadcast_from_last_rank(results):
    size = results[0]["size"]
    for res in results:
        assert res["join_last"] == size - 1  # the rank with the most batches joins last
        assert res["join_differ_before"]  # ranks that ran out of data held other weights
        assert res["join_same_after"] and res["join_kept_last"]


HIDE = """
import importlib.abc, sys
class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
HIDDEN = set(sys.argv[1].split(","))
for m in list(sys.modules):
    if m.split(".")[0] in HIDDEN:
        del sys.modules[m]
sys.meta_path.insert(0, Hide())
try:
    __import__(sys.argv[2])
except ImportError as e:
    print("ImportError:", e)
else:
    print("imported")
"""


@pytest.mark.parametrize(
    "module,hidden,extra",
    [
        ("cring.torch", "torch", "cring[torch]"),
        ("cring.lightning", "lightning,pytorch_lightning", "cring[lightning]"),
        ("cring.lightning", "torch", "cring[lightning]"),
        ("cring.ray", "ray", "cring[ray]"),
    ],
)
def test_missing_framework_says_what_to_install(module, hidden, extra):
    out = subprocess.run(
        [sys.executable, "-c", HIDE, hidden, module],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ImportError:"), out.stdout + out.stderr
    assert f'pip install "{extra}"' in out.stdout


def test_cring_imports_without_torch():
    out = subprocess.run(
        [sys.executable, "-c", HIDE, "torch,lightning,ray", "cring"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.stdout.strip() == "imported", out.stdout + out.stderr


def test_horovod_knobs_are_honoured(tmp_path):
    """HOROVOD_FUSION_THRESHOLD / CYCLE_TIME / TIMELINE(_MARK_CYCLES) / LOG_LEVEL become their
    CRING_* equivalents (a CRING_* variable set too wins), the timeline is
    written, and one warning lists the settings cring has no equivalent for."""
    env = {
        "HOROVOD_FUSION_THRESHOLD": "1048576",
        "HOROVOD_CYCLE_TIME": "3.5",
        "HOROVOD_TIMELINE": str(tmp_path / "hvd_trace.json"),
        "HOROVOD_LOG_LEVEL": "fatal",
        "HOROVOD_CACHE_CAPACITY": "64",
        "CRING_CACHE_CAPACITY": "128",
        "HOROVOD_HIERARCHICAL_ALLREDUCE": "1",
        "HOROVOD_TIMELINE_MARK_CYCLES": "1",
        "HOROVOD_TORUS_ALLREDUCE": "1",
        "HOROVOD_GPU_OPERATIONS": "XLA",
    }
    run_ranks(2, "horovod_env.py", str(tmp_path), env=env, timeout=120)
    for res in rank_results(tmp_path, 2):
        got = res["env"]
        assert got["CRING_FUSION_THRESHOLD"] == "1048576"
        assert got["CRING_CYCLE_TIME"] == "3.5"
        assert got["CRING_LOG_LEVEL"] == "error"
        assert got["CRING_CACHE_CAPACITY"] == "128"  # CRING_* wins
        assert got["CRING_TIMELINE_MARK_CYCLES"] == "1"
        assert len(res["warnings"]) == 1, res["warnings"]
        message = res["warnings"][0]
        for name in (
            "HOROVOD_HIERARCHICAL_ALLREDUCE",
            "HOROVOD_TORUS_ALLREDUCE",
            "HOROVOD_GPU_OPERATIONS='XLA'",
        ):
            assert name in message
        assert "HOROVOD_FUSION_THRESHOLD" not in message
        assert "HOROVOD_TIMELINE_MARK_CYCLES" not in message
    # Horovod's layout: the exact path, written by rank 0, cycles marked
    assert not list(tmp_path.glob("hvd_trace.*.json"))
    events = json.loads((tmp_path / "hvd_trace.json").read_text())
    assert any("allreduce.hvd_env.0" in json.dumps(e) for e in events)
    assert any(e.get("name") == "CYCLE_START" for e in events)


def test_horovod_env_table_unit():
    from cring import _horovod_env

    env = {
        "HOROVOD_STALL_CHECK_DISABLE": "1",
        "HOROVOD_STALL_CHECK_TIME_SECONDS": "5",
        "HOROVOD_RANK": "0",
        "HOROVOD_GPU_OPERATIONS": "NCCL",
    }
    applied = _horovod_env.apply_horovod_environment(env)
    assert env["CRING_STALL_CHECK_SECONDS"] == "1e12"  # disabling wins over a check time
    assert env["CRING_GPU_OPERATIONS"] == "nccl"
    assert sorted(applied) == ["CRING_GPU_OPERATIONS", "CRING_STALL_CHECK_SECONDS"]
    env = {"HOROVOD_STALL_CHECK_DISABLE": "0", "HOROVOD_STALL_CHECK_TIME_SECONDS": "5"}
    _horovod_env.apply_horovod_environment(env)
    assert env["CRING_STALL_CHECK_SECONDS"] == "5"
    # Horovod's own tests set HOROVOD_TIMELINE=DYNAMIC: no file until start_timeline()
    env = {"HOROVOD_TIMELINE": "DYNAMIC", "HOROVOD_TIMELINE_MARK_CYCLES": "1"}
    _horovod_env.apply_horovod_environment(env)
    assert "CRING_TIMELINE" not in env and env["CRING_TIMELINE_MARK_CYCLES"] == "1"


def test_example_with_uneven_data_joins_and_ends_identical():
    """examples/train_torch.py --uneven: ranks run out of data at different
    steps, join(), then take the weights of the rank join() returns."""
    proc = run_ranks(
        2,
        "../../examples/train_torch.py",
        "--uneven",
        "--samples",
        "4000",
        "--epochs",
        "2",
        timeout=240,
    )
    assert "parameters identical on all ranks: True" in proc.stdout, proc.stdout[-3000:]
