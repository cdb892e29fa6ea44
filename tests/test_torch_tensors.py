"""cring on torch tensors (torch is optional for cring; these tests need it):
torch in, torch out; in-place allreduce keeps the data pointer."""

import pytest

from conftest import run_ranks

torch = pytest.importorskip("torch")


def test_torch_in_place_and_kinds(tmp_path):
    proc = run_ranks(2, "torch_tensors.py", timeout=120)
    assert proc.stdout.count("torch ok") == 2


def test_import_cring_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, cring; assert 'torch' not in sys.modules; print('clean')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "clean", out.stderr
