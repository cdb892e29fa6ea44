# Runs scripts/check_layers.py on this source tree: no import loop among the
# python/cring modules and no C file including another layer's internal header.
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "check_layers.py"


def test_layers_import_one_way():
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--root", str(ROOT)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _check(tmp_path, files):
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (tmp_path / "csrc").mkdir(exist_ok=True)
    (tmp_path / "python" / "cring").mkdir(parents=True, exist_ok=True)
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--root", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_check_finds_a_deferred_import_loop(tmp_path):
    result = _check(
        tmp_path,
        {
            "python/cring/__init__.py": "",
            "python/cring/a.py": "from . import b\n",
            "python/cring/b.py": "def f():\n    from . import a\n",
            "python/cring/c.py": "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from . import d\n",
            "python/cring/d.py": "from . import c\n",
        },
    )
    assert result.returncode == 1
    assert "function-level import among cring.a, cring.b" in result.stdout
    assert "cring.c" not in result.stdout  # TYPE_CHECKING imports never run


def test_the_check_finds_internal_and_upward_includes(tmp_path):
    result = _check(
        tmp_path,
        {
            "csrc/include/cring/cring.h": "",
            "csrc/core/comm_internal.h": "",
            "csrc/reduce/reduce_impl.h": "",
            "csrc/engine/engine.c": (
                '#include "../core/comm_internal.h"\n#include "cring/cring.h"\n'
            ),
            "csrc/pyext/module.c": '#include "../core/comm_internal.h"\n',
            "csrc/algo/ring.c": '#include "reduce/reduce_impl.h"\n#include "../engine/x.h"\n',
            "csrc/engine/x.h": "",
            "csrc/tests/test_x.c": '#include "reduce/reduce_impl.h"\n',
        },
    )
    assert result.returncode == 1
    out = result.stdout
    assert "csrc/pyext/module.c: includes core/comm_internal.h" in out
    assert "csrc/algo/ring.c: includes reduce/reduce_impl.h, internal to the reduce" in out
    assert "csrc/algo/ring.c: includes engine/x.h from the engine layer, above algo" in out
    assert "engine.c" not in out and "test_x.c" not in out
