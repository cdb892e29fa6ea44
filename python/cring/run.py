# cringrun's entry point, kept here so that `python -m cring.run` and the
# `cringrun` console script (pyproject: cring.run:main) stay as they were.
# The launcher itself is the package cring.launch; nothing else belongs here.
#
# `cring.run` is also a function (Horovod's horovod.run, cring._run_api),
# the package attribute that cring/__init__ sets. Importing this module
# (`import cring.run`, `from cring.run import main`) makes Python set the
# package attribute to the module instead; so the module is callable too and
# forwards to the function, and `cring.run(fn, ...)` works either way. The
# launcher is imported only when main() runs, so `import cring.run` is light.
"""Launch N local processes of one command as the ranks of a cring job.

    cringrun -np N [options] [--] command [args ...]
    python -m cring.run -np N [options] [--] command [args ...]

See cring.launch for the options, the environment of every rank, the output,
signals and exit status, and elastic mode (docs/elastic.md).
"""

from __future__ import annotations

import sys
import types
from collections.abc import Sequence
from typing import Any

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run cringrun with argv (default sys.argv[1:]); return the exit status."""
    from cring.launch import main as launcher_main

    return launcher_main(argv)


class _CallableModule(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from cring._run_api import run

        return run(*args, **kwargs)


if __name__ == "__main__":
    sys.exit(main())
else:
    sys.modules[__name__].__class__ = _CallableModule
