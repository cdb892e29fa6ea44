# What this cring install can do, for `cringrun --check-build` and
# `python -m cring.info`: reads and reports only. Never initialises a job,
# never imports a framework (their metadata says what is installed), never
# changes the environment.
"""Report what this cring install can do (``cringrun --check-build``).

    python -m cring.info

Prints cring's version and location; the frameworks found (torch, Lightning,
Ray) with their versions; the transports; the reduction kernels the C core
picked for this CPU; NCCL and the CUDA runtime if they load (path, version,
GPUs seen); one ``WARNING:`` line per known defect of the loaded versions; and
the effective knobs (``CRING_*`` set in the environment, ``HOROVOD_*`` mapped
to ``CRING_*``). ``collect()`` returns the same as a dict.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys
from typing import Optional

from . import _C
from ._gpu import cuda_info, nccl_info
from ._horovod_env import _UNDERSTOOD, HOROVOD_TO_CRING
from ._version import __version__

__all__ = ["KNOWN_DEFECTS", "collect", "known_defects", "main", "report"]

# (label, top-level modules tried in order, distributions giving the version, cring adapter, extra)
_FRAMEWORKS = (
    ("torch", ("torch",), ("torch",), "cring.torch", "torch"),
    ("Lightning", ("lightning", "pytorch_lightning"), ("lightning", "pytorch-lightning"),
     "cring.lightning", "lightning"),
    ("Ray", ("ray",), ("ray",), "cring.ray", "ray"),
)  # fmt: skip

# Known defects of libraries cring loads: (library, first affected version
# code, first fixed version code, what goes wrong and what to do). NCCL codes
# use NCCL's convention since 2.9: major*10000 + minor*100 + patch.
KNOWN_DEFECTS = (
    (
        "NCCL",
        22700,
        22907,
        "a communicator of one rank (world size 1, or a process set of one rank) corrupts "
        "Average and PreMulSum results (prescale/postscale factors): its reduce kernel leaves "
        "the last n % blocks elements unwritten (NVIDIA/nccl issue 1950, fixed in 2.29.7). "
        "cring guards its own calls against it; other code sharing this NCCL is still hit. "
        "Upgrade: pip install -U nvidia-nccl-cu12 (or -cu13)",
    ),
)

# Knobs whose value must not be printed.
_SECRET_KNOBS = frozenset({"CRING_SECRET"})


def _nccl_code(code: Optional[int]) -> Optional[int]:
    """An NCCL version code in the major*10000+minor*100+patch convention (NCCL
    before 2.9 reported major*1000+minor*100+patch)."""
    if not code:
        return None
    if code < 10000:
        return code // 1000 * 10000 + code % 1000
    return code


def _version_text(code: int) -> str:
    return f"{code // 10000}.{code // 100 % 100}.{code % 100}"


def known_defects(nccl_version_code: Optional[int]) -> list[str]:
    """The WARNING lines for the known defects of this NCCL version code
    (either of NCCL's conventions; None: NCCL not loaded)."""
    code = _nccl_code(nccl_version_code)
    warnings = []
    for library, first, fixed, what in KNOWN_DEFECTS:
        if library == "NCCL" and code is not None and first <= code < fixed:
            warnings.append(
                f"{library} {_version_text(code)} (affected: {_version_text(first)} to before "
                f"{_version_text(fixed)}): {what}"
            )
    return warnings


def _framework(label: str, modules: tuple, dists: tuple, adapter: str, extra: str) -> dict:
    """Whether a framework is importable and its version, without importing it."""
    for module in modules:
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            continue
        version = None
        for dist in dists:
            try:
                version = importlib.metadata.version(dist)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
        location = next(iter(spec.submodule_search_locations or []), spec.origin)
        return {
            "name": label,
            "found": True,
            "module": module,
            "version": version,
            "path": location,
            "adapter": adapter,
        }
    return {"name": label, "found": False, "adapter": adapter, "extra": f"cring[{extra}]"}


def _transports(environ: dict) -> list[dict]:
    shm_dir = "/dev/shm"
    shm_ok = os.path.isdir(shm_dir) and os.access(shm_dir, os.W_OK | os.X_OK)
    shm_note = f"{shm_dir} not writable: one host uses tcp"
    if shm_ok:
        stat = os.statvfs(shm_dir)
        shm_note = f"{shm_dir}, {stat.f_bavail * stat.f_frsize / 2**30:.1f} GiB free"
    return [
        {"name": "shm", "available": shm_ok, "use": "ranks on one host", "note": shm_note},
        {"name": "tcp", "available": True, "use": "any hosts (segmented ring)", "note": ""},
        {
            "name": "hierarchical",
            "available": shm_ok,
            "use": "several hosts: shm within each host, tcp across",
            "note": "needs the same number of ranks on every host",
        },
    ]


def _knobs(environ: dict) -> list[dict]:
    """CRING_* set in the environment, and what each HOROVOD_* becomes."""
    rows = []
    for name in sorted(k for k in environ if k.startswith("CRING_")):
        value = "(set, not shown)" if name in _SECRET_KNOBS else environ[name]
        rows.append({"name": name, "value": value, "source": "environment"})
    for name in sorted(k for k in environ if k.startswith("HOROVOD_")):
        row = HOROVOD_TO_CRING.get(name)
        if row is None:
            if name not in _UNDERSTOOD:
                rows.append(
                    {"name": name, "value": environ[name], "source": "ignored: no cring equivalent"}
                )
            continue
        cring_name, convert = row
        value = convert(environ[name])
        source = f"from {name}={environ[name]}"
        if value is None:
            rows.append(
                {"name": name, "value": environ[name], "source": "ignored: value not understood"}
            )
        elif value and cring_name in environ:
            rows.append(
                {"name": name, "value": environ[name], "source": f"ignored: {cring_name} is set"}
            )
        elif value:
            rows.append({"name": cring_name, "value": value, "source": source})
    return rows


def collect(environ: Optional[dict] = None) -> dict:
    """Everything report() prints, as a dict. Loads NCCL and the CUDA runtime
    if it can (as the first CUDA collective would); starts nothing else."""
    env = dict(os.environ if environ is None else environ)
    nccl = nccl_info()
    nccl_code = _nccl_code(nccl.get("version_code"))
    return {
        "version": __version__,
        "location": os.path.dirname(os.path.abspath(__file__)),
        "extension": getattr(_C, "__file__", None),
        "python": f"{sys.version.split()[0]} ({sys.executable})",
        "frameworks": [_framework(*row) for row in _FRAMEWORKS],
        "transports": _transports(env),
        "transport_setting": env.get("CRING_TRANSPORT", "auto"),
        "reduce_kernels": _C.reduce_isa(),
        "reduce_cap": env.get("CRING_REDUCE_ISA"),
        "nccl": dict(nccl, version=_version_text(nccl_code) if nccl_code else None),
        "cuda": cuda_info(),
        "warnings": known_defects(nccl_code),
        "knobs": _knobs(env),
        "shm_tuning": _shm_tuning(env),
        "result_cache": dict(_C.result_cache_stats(), set="CRING_RESULT_CACHE_BYTES" in env),
    }


# The shared-memory collectives' sizes: (key, what it is, knob, how the default is derived)
_SHM_SIZES = (
    ("round_bytes", "rounds", "CRING_SHM_ROUND_BYTES", "L2 / 4"),
    ("small_allreduce_bytes", "one-exchange allreduce up to", "CRING_SHM_SMALL_BYTES", "L1d / 3"),
    ("reduce_block_bytes", "reduce blocks", "CRING_SHM_REDUCE_BLOCK_BYTES", "L1d x 2/3"),
    (
        "stream_min_bytes",
        "streaming stores from",
        "CRING_SHM_STREAM_MIN_BYTES",
        "L3 per CPU sharing it / 2",
    ),
    ("inplace_round_bytes", "shared-region rounds", "CRING_SHM_INPLACE_ROUND_BYTES", "L3 / 8"),
    (
        "inplace_stream_min_bytes",
        "shared-region streaming from",
        "CRING_SHM_INPLACE_STREAM_MIN_BYTES",
        "L2 / 4",
    ),
)


def _shm_tuning(environ: dict) -> dict:
    """The shared-memory sizes (_C.shm_tuning) and which knobs set them."""
    tuning = dict(_C.shm_tuning())
    tuning["set"] = [knob for _, _, knob, _ in _SHM_SIZES if knob in environ]
    return tuning


def _bytes(n: int) -> str:
    if not n:
        return "unknown"
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def _shm_lines(tuning: dict) -> list:
    """The shared-memory sizes, and where each comes from (derived or set)."""
    lines = [
        f"    caches: L1d {_bytes(tuning['l1d_bytes'])}, L2 {_bytes(tuning['l2_bytes'])}, "
        f"L3 {_bytes(tuning['l3_bytes'])} (cpu0, as the machine reports them)"
    ]
    for key, what, knob, rule in _SHM_SIZES:
        source = f"{knob} is set" if knob in tuning["set"] else f"{rule}; {knob}"
        lines.append(f"    {what + ':':<30} {_bytes(tuning[key]):>9}  ({source})")
    return lines


def _result_cache_lines(cache: dict) -> list:
    """Where large CPU results come from, and the cache's limit."""
    source = (
        "CRING_RESULT_CACHE_BYTES is set" if cache["set"] else "default; CRING_RESULT_CACHE_BYTES"
    )
    if not cache["limit_bytes"]:
        return [
            f"    off ({source}): results are NumPy's and torch's own arrays; allgather "
            "and alltoall results are mapped for each call"
        ]
    return [
        f"    results of {_bytes(cache['min_bytes'])} or more: "
        "blocks reused from a cache of freed ones",
        f"    {'kept at most:':<30} {_bytes(cache['limit_bytes']):>9}  ({source})",
    ]


def _mark(flag: bool) -> str:
    return "[X]" if flag else "[ ]"


def report(info: Optional[dict] = None) -> str:
    """The text of `cringrun --check-build`."""
    info = collect() if info is None else info
    lines = [
        f"cring {info['version']}",
        f"    installed at: {info['location']}",
        f"    extension:    {info['extension']}",
        f"    Python:       {info['python']}",
        "",
        "Frameworks:",
    ]
    for fw in info["frameworks"]:
        if fw["found"]:
            version = fw["version"] or "version unknown"
            lines.append(
                f"    {_mark(True)} {fw['name']} {version} ({fw['path']}; {fw['adapter']})"
            )
        else:
            lines.append(
                f"    {_mark(False)} {fw['name']} (not installed; for {fw['adapter']}: "
                f"pip install '{fw['extra']}')"
            )
    lines += ["", f"Transports (CRING_TRANSPORT={info['transport_setting']}):"]
    for t in info["transports"]:
        note = f"; {t['note']}" if t["note"] else ""
        lines.append(f"    {_mark(t['available'])} {t['name']:<13} {t['use']}{note}")
    cap = f", capped by CRING_REDUCE_ISA={info['reduce_cap']}" if info["reduce_cap"] else ""
    lines += [
        "",
        "Reduction kernels:",
        f"    {info['reduce_kernels']} (picked for this CPU at run time{cap})",
        "",
        "GPU (NCCL and the CUDA runtime are loaded at run time, never linked):",
    ]
    nccl, cuda = info["nccl"], info["cuda"]
    if nccl["available"]:
        lines.append(f"    {_mark(True)} NCCL {nccl['version']}: {nccl['path']}")
    else:
        lines.append(f"    {_mark(False)} NCCL: {nccl['error']}")
    if cuda["path"]:
        v = cuda["runtime_version"] or 0
        count = cuda["device_count"]
        seen = f"{count} GPU{'s' if count != 1 else ''} seen" if count else "no GPU seen"
        lines.append(
            f"    {_mark(cuda['available'])} CUDA runtime {v // 1000}.{v % 1000 // 10}: "
            f"{cuda['path']}; {seen}"
        )
    else:
        lines.append(f"    {_mark(False)} CUDA runtime: {cuda['error']}")
    if "shm_tuning" in info:
        lines += ["", "Shared-memory sizes (rank 0's are used by the job):"]
        lines += _shm_lines(info["shm_tuning"])
    if "result_cache" in info:
        lines += ["", "Result memory (large CPU results cring allocates):"]
        lines += _result_cache_lines(info["result_cache"])
    lines += ["", "Known defects of the loaded libraries:"]
    lines += [f"    WARNING: {w}" for w in info["warnings"]] or ["    none"]
    lines += ["", "Knobs (CRING_* set here, HOROVOD_* as cring reads them):"]
    for k in info["knobs"]:
        lines.append(f"    {k['name']}={k['value']}  ({k['source']})")
    if not info["knobs"]:
        lines.append("    none set: every knob at its default (README, 'Environment variables')")
    return "\n".join(lines)


def main(argv: Optional[list] = None) -> int:
    print(report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
