/* shm_tune.c: the sizes the shared-memory algorithms work in (rounds, the
 * small form, reduce blocks, where streaming stores start), derived from the
 * caches this machine reports, each overridable by a CRING_SHM_* variable.
 * Reads sysfs, sysconf and the environment only; moves no data. Rank 0's
 * choice travels in the segment's header (comm.c), so every rank uses it.
 *
 * Why these sizes follow the caches (docs/performance.md, "Sizes from the
 * machine"): within a large allreduce each rank writes its window half and
 * reads its peer's, and a half is rewritten two rounds later; the lines of
 * both halves of both windows (4 x the round) must stay in the core's L2
 * between a peer's write and the reads, or every round's copies and
 * reductions go to the L3 or to the other core's cache at a fraction of the
 * speed. A round sized for a 2 MiB L2 thus overflows a 512 KiB one. The small
 * form reduces a whole message from every rank's copy, its reduce blocks go
 * out while in L1, and only outputs too large to stay in this core's share
 * of the L3 are written with streaming stores: a smaller one stays in the
 * L3 and is what the caller reads next (streaming it to memory made a
 * 1-4 MiB allgather 2.3x slower on a 32 MiB L3, and saved 10% when every
 * call's data came from memory). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "algo.h"
#include "shm_layout.h"

/* How many CPUs a sysfs shared_cpu_list names ("0-3,8,10-11"); 1 if unreadable. */
static int cpus_in_list(const char *path) {
    FILE *f = fopen(path, "r");
    char buf[256];
    int n = 0;
    if (!f) return 1;
    if (fgets(buf, sizeof buf, f)) {
        for (char *p = buf; *p && *p != '\n';) {
            char *end;
            long a = strtol(p, &end, 10), b = a;
            if (end == p) break;
            if (*end == '-') b = strtol(end + 1, &end, 10);
            n += (int)(b - a + 1);
            p = *end == ',' ? end + 1 : end;
            if (end == p && *p != ',') break;
        }
    }
    fclose(f);
    return n > 0 ? n : 1;
}

/* Bytes of this machine's cache of `level` ("Data"/"Unified" for level 1 is
 * the data cache) as sysfs reports it for cpu0, else sysconf's; 0 unknown.
 * *sharing (if given) gets how many CPUs share it (1 where unknown). */
static size_t cache_bytes(int level, int *sharing) {
    if (sharing) *sharing = 1;
    for (int i = 0; i < 8; i++) {
        char path[128], buf[32];
        int lvl = 0;
        snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/level", i);
        FILE *f = fopen(path, "r");
        if (!f) break;
        int got = fscanf(f, "%d", &lvl);
        fclose(f);
        if (got != 1 || lvl != level) continue;
        snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/type", i);
        if (!(f = fopen(path, "r"))) continue;
        got = fgets(buf, sizeof buf, f) != NULL;
        fclose(f);
        if (!got || strncmp(buf, "Instruction", 11) == 0) continue;
        snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/size", i);
        if (!(f = fopen(path, "r"))) continue;
        unsigned long n = 0;
        char unit = 0;
        got = fscanf(f, "%lu%c", &n, &unit);
        fclose(f);
        if (got < 1 || n == 0) continue;
        snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/shared_cpu_list",
                 i);
        if (sharing) *sharing = cpus_in_list(path);
        return unit == 'K' ? n << 10 : unit == 'M' ? n << 20 : unit == 'G' ? n << 30 : n;
    }
#ifdef _SC_LEVEL1_DCACHE_SIZE
    long v = sysconf(level == 1   ? _SC_LEVEL1_DCACHE_SIZE
                     : level == 2 ? _SC_LEVEL2_CACHE_SIZE
                                  : _SC_LEVEL3_CACHE_SIZE);
    if (v > 0) return (size_t)v;
#endif
    return 0;
}

/* The largest power of two <= n (n > 0), clamped to [lo, hi]. */
static size_t pow2_clamp(size_t n, size_t lo, size_t hi) {
    size_t p = 1;
    while (p <= n / 2) p *= 2;
    return p < lo ? lo : p > hi ? hi : p;
}

/* One size: the variable's value when set (at least `lo`, a multiple of a
 * cache line), else the derived one. */
static size_t knob(const char *name, size_t derived, size_t lo) {
    long v = cring__env_long(name, -1);
    if (v < 0) return derived;
    size_t n = (size_t)v < lo ? lo : (size_t)v;
    return n / CRING_CACHE_LINE * CRING_CACHE_LINE;
}

void cring_shm_tuning(cring_shm_tuning_t *t) {
    memset(t, 0, sizeof *t);
    int l3_sharing = 1;
    t->l1d_bytes = cache_bytes(1, NULL);
    t->l2_bytes = cache_bytes(2, NULL);
    t->l3_bytes = cache_bytes(3, &l3_sharing);
    /* a cache the machine does not report: sizes that give the constants
     * cring used before they were derived (256 KiB rounds, 16 KiB small
     * form, 32 KiB blocks, streaming from 1 MiB, 4 MiB in-place rounds) */
    const size_t l1 = t->l1d_bytes ? t->l1d_bytes : 48u << 10;
    const size_t l2 = t->l2_bytes ? t->l2_bytes : 1u << 20;
    const size_t l3 = t->l3_bytes ? t->l3_bytes : 32u << 20;
    t->round_bytes = knob("CRING_SHM_ROUND_BYTES", pow2_clamp(l2 / 4, 64u << 10, 1u << 20), 4096);
    t->small_allreduce_bytes =
        knob("CRING_SHM_SMALL_BYTES", pow2_clamp(l1 / 3, 4u << 10, 64u << 10), 0);
    t->reduce_block_bytes =
        knob("CRING_SHM_REDUCE_BLOCK_BYTES", pow2_clamp(l1 * 2 / 3, 8u << 10, 64u << 10), 1024);
    /* streaming stores pay only for an output that would not stay in the
     * last-level cache: half this core's share of the L3 (the L2 where no L3
     * is reported) */
    const size_t l3_share = t->l3_bytes ? t->l3_bytes / (size_t)l3_sharing / 2 : l2;
    t->stream_min_bytes =
        knob("CRING_SHM_STREAM_MIN_BYTES", pow2_clamp(l3_share, 1u << 20, 8u << 20), 4096);
    t->inplace_round_bytes =
        knob("CRING_SHM_INPLACE_ROUND_BYTES", pow2_clamp(l3 / 8, 1u << 20, 4u << 20), 4096);
    t->inplace_stream_min_bytes =
        knob("CRING_SHM_INPLACE_STREAM_MIN_BYTES", pow2_clamp(l2 / 4, 64u << 10, 1u << 20), 4096);
}

void cring__shm_tuning_params(uint64_t params[CRING__SHM_PARAMS]) {
    cring_shm_tuning_t t;
    cring_shm_tuning(&t);
    memset(params, 0, sizeof(uint64_t) * CRING__SHM_PARAMS);
    params[SHM_P_ROUND] = t.round_bytes;
    params[SHM_P_SMALL] = t.small_allreduce_bytes;
    params[SHM_P_BLOCK] = t.reduce_block_bytes;
    params[SHM_P_STREAM] = t.stream_min_bytes;
    params[SHM_P_INPLACE_ROUND] = t.inplace_round_bytes;
    params[SHM_P_INPLACE_STREAM] = t.inplace_stream_min_bytes;
}
