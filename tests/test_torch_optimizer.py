"""cring.torch's DistributedOptimizer, broadcast_parameters and
broadcast_optimizer_state on real processes (2 and 3 ranks): training equals
single-process training on the concatenated batch, gradients are fused and
their allreduces start during backward, the guards and controls behave as in
Horovod, and broadcasting makes every rank's model and optimizer state equal
to root's. Each worker packs many checks into one run and writes
<tmp>/rank<R>.json (tests/workers/torch_opt_*.py)."""

import pytest

from conftest import rank_results, run_ranks

pytest.importorskip("torch")

TIMEOUT_S = 120  # per job; each normally ends within 10 s
# float64 training: the distributed and single-process runs differ only in the order
# of summation (per-rank means averaged vs one mean), ~1e-16; far inside 1e-5
REL_TOL = 1e-10


def run_worker(tmp_path, np_, script, *args):
    proc = run_ranks(np_, script, str(tmp_path), *args, timeout=TIMEOUT_S, check=False)
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-4000:]
    results = rank_results(tmp_path, np_)
    for r, res in enumerate(results):
        assert res["rank"] == r and res["size"] == np_
    return results


def failures(results, label):
    return [f for res in results for f in res["failures"] if f.startswith(label + ":")]


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def trained(request, tmp_path_factory):
    np_ = request.param
    return np_, run_worker(tmp_path_factory.mktemp(f"train{np_}"), np_, "torch_opt_train.py")


def scenario(results, name):
    """The scenario's result on rank 0, after checking every rank ended identical."""
    assert failures(results, name) == []
    first = results[0]["scenarios"][name]
    for res in results[1:]:
        assert res["scenarios"][name]["params"] == first["params"], f"{name}: ranks differ"
    return first


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_training_equals_one_process(trained, name):
    """SGD with momentum and weight decay, and Adam: every rank on its own data, with
    a frozen parameter and one that only rank 0 uses (no gradient elsewhere)."""
    _, results = trained
    s = scenario(results, name)
    assert s["rel_err"] <= REL_TOL, s["rel_err"]
    assert s["moved"] > 1e-3  # the comparison means something: training moved the weights


@pytest.mark.parametrize("name", ["sgd_bpps2", "adam_bpps2"])
def test_backward_passes_per_step(trained, name):
    """Two micro-batches accumulate locally, one allreduce per step: equals one
    process accumulating the two concatenated micro-batches."""
    _, results = trained
    s = scenario(results, name)
    assert s["rel_err"] <= REL_TOL, s["rel_err"]


@pytest.mark.parametrize(
    "name,plain",
    [
        ("sgd_groups2", "sgd"),
        ("sgd_groups_list", "sgd"),
        ("adam_groups_list", "adam"),
        ("sgd_predivide", "sgd"),
    ],
)
def test_groups_and_predivide_equal_plain(trained, name, plain):
    """groups= (an int; lists, the rest alone) and gradient_predivide_factor
    give the ungrouped, undivided results (up to rounding) and the one-process ones."""
    _, results = trained
    s, p = scenario(results, name), scenario(results, plain)
    assert s["rel_err"] <= REL_TOL
    diff = max(abs(a - b) for a, b in zip(s["params"], p["params"]))
    assert diff <= REL_TOL * max(abs(b) for b in p["params"]), diff


def test_gradients_fused_and_started_during_backward(trained):
    """121 small gradients: the hooks started every allreduce of a gradient
    that backward produced before backward returned, the engine ran them as a
    few fused collectives per step (not one per parameter), and the result is right."""
    np_, results = trained
    s = scenario(results, "many")
    print(
        f"{np_} ranks: {s['trainable']} gradients per step ran as "
        f"{s['collectives_per_step']:.1f} collectives"
    )
    assert s["rel_err"] <= REL_TOL
    assert all(res["scenarios"]["many"]["submitted_before_step"] == 1.0 for res in results)
    assert s["collectives_per_step"] <= s["trainable"] / 10, s


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def api(request, tmp_path_factory):
    np_ = request.param
    return np_, run_worker(tmp_path_factory.mktemp(f"api{np_}"), np_, "torch_opt_api.py", "1")


@pytest.mark.parametrize(
    "label",
    [
        "arguments",
        "wrapper is the optimizer",
        "zero_grad while in flight",
        "too many backward passes",
        "skip_synchronize",
        "sparse gradients",
        "compression",
    ],
)
def test_optimizer_controls(api, label):
    """Duplicate or missing names, predivide with Sum, Adasum, bad groups:
    errors. The wrapper is an instance of the optimizer's class with a working
    state_dict. zero_grad while gradients are in flight (or being accumulated)
    raises AssertionError, as in Horovod; so does a backward pass too many.
    synchronize + clip + step in skip_synchronize uses the clipped average.
    Sparse gradients raise NotImplementedError unless sparse_as_dense.
    Compression.fp16/bf16 and a Horovod-style compressor give the average to
    16-bit precision."""
    _, results = api
    assert failures(results, label) == []


def test_freezing_is_honoured_at_step_time(api):
    """requires_grad_(False) after DistributedOptimizer was built: AdamW (weight
    decay) leaves the layer exactly where it was, as DDP does, and every
    parameter equals DDP's (plain and gradient_as_bucket_view). A layer frozen
    when the optimizer was built and unfrozen later is averaged from then on."""
    _, results = api
    assert failures(results, "freezing") == []
    assert failures(results, "unfreezing") == []


@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_broadcast_makes_ranks_equal_root(api, kind):
    """Different weights, data, learning rates and step counts (Adam's
    moments and step, SGD's momentum; a fresh optimizer on rank 2): after
    broadcast_parameters + broadcast_optimizer_state from rank 1, every rank's
    parameters, optimizer state and hyperparameters equal root's exactly, and
    training on keeps them equal."""
    np_, results = api
    root = 1
    assert failures(results, f"broadcast {kind}") == []
    states = [res["states"][kind] for res in results]
    assert states[0]["before"] != states[root]["before"]
    assert states[0]["before"]["state"] != states[root]["before"]["state"]
    for r, s in enumerate(states):
        for part in ("params", "state", "groups"):
            assert s["after"][part] == states[root]["before"][part], (r, part)
        assert s["trained_on"] == states[0]["trained_on"], r


def test_broadcast_state_edge_cases(api):
    """All fresh: nothing is created and nothing moves. Different parameter
    counts: ValueError on every rank, and cring works afterwards."""
    _, results = api
    assert failures(results, "fresh everywhere") == []
    assert failures(results, "mismatched layout") == []


@pytest.mark.parametrize("np_", [1, 2])
def test_example_trains(np_):
    """examples/train_torch.py (shortened) trains and ends with identical
    parameters on every rank; with one rank the wrapped optimizer runs alone."""
    proc = run_ranks(
        np_,
        "../../examples/train_torch.py",
        "--samples",
        "4000",
        "--epochs",
        "1",
        timeout=TIMEOUT_S,
    )
    assert "parameters identical on all ranks: True" in proc.stdout, proc.stdout[-3000:]
