"""cring.torch under torch.compile, on 2 real ranks (tests/workers/torch_compile.py,
one job, hard timeout): the collectives are torch operators (cring::allreduce,
::allgather, ::broadcast, ::grouped_allreduce) with shape functions, so a
function calling hvd.allreduce, hvd.allgather and hvd.broadcast compiles as one
graph with fullgraph=True, no warning from cring, and values and gradients
equal to eager's; a DistributedOptimizer step compiled with compiled autograd
has no graph break in cring. In-process: importing cring.torch stays cheap."""

import subprocess
import sys

import pytest

from conftest import rank_results, run_ranks

pytest.importorskip("torch")

TIMEOUT_S = 600  # compiling is slow on a loaded 2-core machine; one run is normally ~1-2 min


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("compile")
    # a fresh compile cache that both ranks share, as on one machine: nothing of a
    # rank's own (its rank, its rows of a gather) may come out of the other's artifacts
    env = {"TORCHINDUCTOR_CACHE_DIR": str(out / "inductor_cache")}
    proc = run_ranks(2, "torch_compile.py", str(out), env=env, timeout=TIMEOUT_S, check=False)
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-4000:]
    results = rank_results(out, 2)
    for r, res in enumerate(results):
        assert res["rank"] == r and res["size"] == 2
    return results


def failures(results, label):
    return [f for res in results for f in res["failures"] if f.startswith(label + ":")]


@pytest.mark.slow  # the compiling job takes ~30 s of a worker
def test_three_collectives_compile_as_one_graph_equal_to_eager(compiled):
    assert failures(compiled, "three collectives") == []
    for res in compiled:
        assert res["collectives"]["graphs"] == 1 and res["collectives"]["breaks"] == 0
    print("collectives:", compiled[0]["collectives"])


@pytest.mark.slow  # the compiling job takes ~30 s of a worker
def test_uneven_allgather_under_compile_is_a_clear_error(compiled):
    assert failures(compiled, "uneven allgather") == []


@pytest.mark.slow  # the compiling job takes ~30 s of a worker
def test_compiled_training_step_has_no_break_in_cring(compiled):
    assert failures(compiled, "compiled training step") == []
    for res in compiled:
        assert res["training"]["breaks_in_cring"] == []
    print("training step:", compiled[0]["training"])


@pytest.mark.slow  # the compiling job takes ~30 s of a worker
def test_a_layer_unfrozen_later_is_averaged_by_the_compiled_step(compiled):
    assert failures(compiled, "compiled unfreezing") == []


def test_import_stays_cheap_and_registers_the_operators():
    """`import cring.torch` registers the operators (torch.library, a few ms)
    without importing torch's compiler stack (Dynamo, Inductor), which only
    torch.compile loads."""
    code = (
        "import sys, torch\n"
        "import cring.torch\n"
        "assert hasattr(torch.ops.cring, 'allreduce'), 'cring::allreduce is not registered'\n"
        "heavy = ('torch._dynamo', 'torch._inductor')\n"
        "print(sorted(m for m in sys.modules if m.startswith(heavy)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout
