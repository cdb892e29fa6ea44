"""Horovod's environment knobs (HOROVOD_FUSION_THRESHOLD, HOROVOD_TIMELINE, ...)
honoured as their cring equivalents: one table, applied by cring.init() before
anything reads a CRING_* variable. Only environment variables; it never
communicates, and a CRING_* variable the user set always wins.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import MutableMapping
from typing import Callable, Optional

__all__ = ["HOROVOD_TO_CRING", "apply_horovod_environment"]


def _same(value: str) -> Optional[str]:
    return value


def _log_level(value: str) -> Optional[str]:
    # Horovod: trace, debug, info, warning, error, fatal; cring: debug, info, warning, error
    levels = {"trace": "debug", "fatal": "error"}
    v = value.strip().lower()
    return (
        levels.get(v, v) if v in ("trace", "debug", "info", "warning", "error", "fatal") else None
    )


def _stall_check_disable(value: str) -> Optional[str]:
    # HOROVOD_STALL_CHECK_DISABLE=1: no stall warnings; cring's are off past any run's length
    return "1e12" if value.strip().lower() in ("1", "true", "yes", "on") else ""


def _timeline(value: str) -> Optional[str]:
    # HOROVOD_TIMELINE=DYNAMIC: no file until start_timeline() (Horovod's own tests set it)
    return "" if value.strip() == "DYNAMIC" else value


def _gpu_operations(value: str) -> Optional[str]:
    # NCCL: cring's NCCL path; MPI, GLOO, DDL, CCL: stage through host memory as those did
    v = value.strip().upper()
    return "nccl" if v == "NCCL" else "host" if v in ("MPI", "GLOO", "DDL", "CCL") else None


# HOROVOD_* -> (CRING_*, conversion of the value: None, not understood (warned);
# "", nothing to set)
HOROVOD_TO_CRING: dict[str, tuple[str, Callable[[str], Optional[str]]]] = {
    "HOROVOD_FUSION_THRESHOLD": ("CRING_FUSION_THRESHOLD", _same),  # bytes
    "HOROVOD_CYCLE_TIME": ("CRING_CYCLE_TIME", _same),  # milliseconds
    "HOROVOD_TIMELINE": ("CRING_TIMELINE", _timeline),  # written by rank 0, as Horovod's
    "HOROVOD_TIMELINE_MARK_CYCLES": ("CRING_TIMELINE_MARK_CYCLES", _same),
    "HOROVOD_CACHE_CAPACITY": ("CRING_CACHE_CAPACITY", _same),
    "HOROVOD_STALL_CHECK_TIME_SECONDS": ("CRING_STALL_CHECK_SECONDS", _same),
    "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": ("CRING_STALL_SHUTDOWN_SECONDS", _same),
    "HOROVOD_STALL_CHECK_DISABLE": ("CRING_STALL_CHECK_SECONDS", _stall_check_disable),
    "HOROVOD_LOG_LEVEL": ("CRING_LOG_LEVEL", _log_level),
    "HOROVOD_GLOO_TIMEOUT_SECONDS": ("CRING_TIMEOUT_SECONDS", _same),
    "HOROVOD_GPU_OPERATIONS": ("CRING_GPU_OPERATIONS", _gpu_operations),
    "HOROVOD_AUTOTUNE": ("CRING_AUTOTUNE", _same),
    "HOROVOD_AUTOTUNE_LOG": ("CRING_AUTOTUNE_LOG", _same),
    "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": ("CRING_AUTOTUNE_WARMUP_SAMPLES", _same),
    "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": ("CRING_AUTOTUNE_STEPS_PER_SAMPLE", _same),
}

# not warned about: read directly by cring's rank discovery (cring._discovery,
# cring.lightning), or nothing to do (cring's add_process_set needs no opt-in)
_UNDERSTOOD = frozenset(
    {
        "HOROVOD_DYNAMIC_PROCESS_SETS",
        "HOROVOD_RANK",
        "HOROVOD_SIZE",
        "HOROVOD_LOCAL_RANK",
        "HOROVOD_LOCAL_SIZE",
        "HOROVOD_CROSS_RANK",
        "HOROVOD_CROSS_SIZE",
    }
)

_warned = False


def apply_horovod_environment(environ: Optional[MutableMapping[str, str]] = None) -> list:
    """Set CRING_X from HOROVOD_Y for every row of HOROVOD_TO_CRING whose
    HOROVOD_Y is set and whose CRING_X is not (in `environ`, os.environ by
    default, which the C engine reads). Warns once per process, in one
    warning, about the HOROVOD_* variables that have no cring equivalent (or
    a value it does not understand). Returns the CRING_* names it set."""
    global _warned
    env = os.environ if environ is None else environ
    applied, ignored = [], []
    for name in sorted(k for k in env if k.startswith("HOROVOD_")):
        row = HOROVOD_TO_CRING.get(name)
        if row is None:
            if name not in _UNDERSTOOD:
                ignored.append(name)
            continue
        cring_name, convert = row
        value = convert(env[name])
        if value is None:
            ignored.append(f"{name}={env[name]!r}")
        elif value and cring_name not in env:
            env[cring_name] = value
            applied.append(cring_name)
    if ignored and not _warned:
        _warned = True
        warnings.warn(
            "cring ignores these Horovod settings, which have no cring equivalent "
            f"(docs/horovod_migration.md): {', '.join(ignored)}",
            RuntimeWarning,
            stacklevel=_outside_cring(),
        )
    return applied


def _outside_cring() -> int:
    """The stacklevel, for a warning raised in the caller, of the first frame
    outside the cring package: the user's init() call however many of cring's
    own layers (cring.torch.init, the Lightning strategy, ...) lie between."""
    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame, level = frame.f_back, level + 1
    return level
