"""Worker (one rank): is the timeline file valid JSON at every moment, for a
reader in another process while events are being written?

This process (all its threads, engine included) is pinned to the first CPU
it may use, and a reader process to the last, so that reads and writes
really overlap. The reader takes single-syscall snapshots of the file's end
(pread from size - 8 KiB to EOF) for up to SECONDS and stops at the first one
that does not end with the closing "]" of the JSON array. Meanwhile this
process runs async allreduces with long, new names (each adds a ~600-byte
process_name row event besides the phase events).

Usage: engine_timeline_reader.py OUTDIR SECONDS
Prints "reader: clean after N reads" or "reader: torn read N: ...<tail>";
exits 1 when a read was torn. The writer stops after MAX_OPS allreduces.
"""

import os
import subprocess
import sys

import numpy as np

import cring

MAX_OPS = 20_000  # keeps the file under ~20 MB

READER = r"""
import os, sys, time
os.sched_setaffinity(0, {int(sys.argv[3])})
path, seconds = sys.argv[1], float(sys.argv[2])
fd = os.open(path, os.O_RDONLY)
n, t0 = 0, time.monotonic()
while time.monotonic() - t0 < seconds:
    data = os.pread(fd, 1 << 20, max(0, os.fstat(fd).st_size - 8192))
    n += 1
    if not data.rstrip().endswith(b"]"):
        print(f"reader: torn read {n} after {time.monotonic() - t0:.3f} s: file ends with "
              f"{data[-60:]!r}", flush=True)
        sys.exit(1)
print(f"reader: clean after {n} reads", flush=True)
"""


def main():
    outdir, seconds = sys.argv[1], sys.argv[2]
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[0]})  # before init: the engine thread inherits it
    cring.init()
    path = cring.start_timeline(f"{outdir}/live.json")
    reader = subprocess.Popen([sys.executable, "-c", READER, path, seconds, str(cpus[-1])])
    k = 0
    while reader.poll() is None and k < MAX_OPS:
        handles = [
            cring.allreduce_async(np.ones(4, np.float32), name=f"live.{k + i:06d}." + "x" * 500)
            for i in range(50)
        ]
        k += 50
        for h in handles:
            cring.synchronize(h)
    cring.stop_timeline()
    cring.shutdown()
    print(f"writer: {k} allreduces", flush=True)
    if reader.poll() is None:  # the writer finished first: nothing torn seen
        reader.terminate()
        reader.wait()
        print("reader: clean until the writer finished", flush=True)
        sys.exit(0)
    sys.exit(reader.returncode)


if __name__ == "__main__":
    main()
