# cringrun's entry point, kept here so that `python -m cring.run` and the
# `cringrun` console script (pyproject: cring.run:main) stay as they were.
# The launcher itself is the package cring.launch; nothing else belongs here.
"""Launch N local processes of one command as the ranks of a cring job.

    cringrun -np N [options] [--] command [args ...]
    python -m cring.run -np N [options] [--] command [args ...]

See cring.launch for the options, the environment of every rank, the output,
signals and exit status, and elastic mode (docs/elastic.md).
"""

from __future__ import annotations

import sys

from cring.launch import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
