/* result_cache.h: memory for large collective results that cring allocates
 * for the caller (allgather and alltoall outputs, out-of-place allreduce,
 * broadcast and reducescatter outputs on the CPU), from one process-wide,
 * bounded cache of recently freed blocks, so that a loop of large calls does
 * not map and fault in fresh pages every time (docs/performance.md, "Result
 * memory"). Knows nothing of tensors, Python or the engine. */
#ifndef CRING_COMMON_RESULT_CACHE_H
#define CRING_COMMON_RESULT_CACHE_H

#include <stddef.h>
#include <stdint.h>

#include "cring/cring.h"

/* Results of at least this many bytes come from the cache; smaller ones
 * from the allocator the caller would use anyway (malloc, numpy.empty). */
#define CRING_RESULT_CACHE_MIN_BYTES ((size_t)1 << 20)
/* The default of CRING_RESULT_CACHE_BYTES: freed bytes kept for reuse. */
#define CRING_RESULT_CACHE_DEFAULT_BYTES ((size_t)256 << 20)

/* A block of at least `bytes` in *block_out: the newest idle block of the
 * same size class (four per doubling: a request of 1.1 MiB and one of
 * 1.2 MiB share one), else a newly mapped one (page-aligned; from 4 MiB
 * 2 MiB-aligned with transparent huge pages asked for, as NumPy asks for its
 * own large arrays). Its contents are undefined. CRING_ERR_NO_MEMORY
 * (*block_out NULL) when the system has no memory even after the idle
 * blocks went back. Hand it back with cring__result_block_put and the same
 * `bytes`. Thread-safe; safe to call before anything else. */
cring_status_t cring__result_block_get(size_t bytes, void **block_out);

/* Hand back a block of cring__result_block_get(bytes): kept for reuse while
 * the cache's idle bytes stay within the limit (the oldest idle blocks are
 * unmapped to make room), unmapped otherwise. block NULL does nothing.
 * Thread-safe, never blocks on anything but the cache's own lock (a DLPack
 * deleter or a garbage collector may call it on any thread). */
void cring__result_block_put(void *block, size_t bytes);

/* Set the limit from CRING_RESULT_CACHE_BYTES (default
 * CRING_RESULT_CACHE_DEFAULT_BYTES; 0 keeps nothing), unmapping idle blocks
 * beyond it. Called at every engine start, so a job started again reads the
 * variable again; the first get or put reads it too. Thread-safe. */
void cring__result_cache_configure(void);

/* Unmap every idle block (lent blocks stay valid and come back later).
 * Thread-safe. */
void cring__result_cache_trim(void);

typedef struct {
    size_t limit_bytes; /* idle bytes the cache may keep */
    size_t idle_bytes;  /* kept now, ready for reuse */
    size_t lent_bytes;  /* in blocks handed out and not yet back */
    uint64_t reused;    /* gets served from the cache */
    uint64_t mapped;    /* gets that mapped a new block */
    uint64_t unmapped;  /* blocks given back to the system (limit, trim) */
} cring__result_cache_stats_t;

/* A consistent snapshot of the cache's figures. Thread-safe. */
void cring__result_cache_stats(cring__result_cache_stats_t *out);

#endif /* CRING_COMMON_RESULT_CACHE_H */
