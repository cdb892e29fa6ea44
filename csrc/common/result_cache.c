/* result_cache.c: the process-wide cache of large result blocks (see
 * result_cache.h): blocks mapped with mmap, handed out, and when handed back
 * kept in a list of idle blocks, newest first, up to CRING_RESULT_CACHE_BYTES
 * (oldest unmapped first). Moves no data and never touches a block's
 * contents; one mutex, held only for the list's bookkeeping.
 *
 * Why: glibc maps every allocation from 32 MiB (its largest mmap threshold)
 * afresh and unmaps it when freed, so a 64 MiB result made per call costs
 * its page faults and the kernel's zeroing every call, about one extra pass
 * over memory (docs/performance.md, "Result memory"). */
#include "result_cache.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "common.h"

#define HUGE_FROM_BYTES ((size_t)4 << 20) /* as NumPy: huge pages asked for from 4 MiB */
#define HUGE_PAGE_BYTES ((size_t)2 << 20)

typedef struct {
    void *block;
    size_t capacity;
} idle_t;

static struct {
    pthread_mutex_t mu;
    size_t page_bytes;
    size_t limit_bytes;
    idle_t *idle; /* newest first */
    size_t nidle, cap_idle;
    cring__result_cache_stats_t stats;
} cache = {.mu = PTHREAD_MUTEX_INITIALIZER};
static pthread_once_t once = PTHREAD_ONCE_INIT;

/* A child of fork() gets the lock released (taken around the fork, so the
 * list it inherits is consistent). */
static void before_fork(void) { pthread_mutex_lock(&cache.mu); }
static void after_fork(void) { pthread_mutex_unlock(&cache.mu); }

static size_t limit_from_env(void) {
    long v = cring__env_long("CRING_RESULT_CACHE_BYTES", (long)CRING_RESULT_CACHE_DEFAULT_BYTES);
    return v > 0 ? (size_t)v : 0;
}

static void init_once(void) {
    long page = sysconf(_SC_PAGESIZE);
    cache.page_bytes = page > 0 ? (size_t)page : 4096;
    cache.limit_bytes = limit_from_env();
    cache.stats.limit_bytes = cache.limit_bytes;
    pthread_atfork(before_fork, after_fork, after_fork);
}

/* The capacity a request of `bytes` gets: its size class, four per doubling
 * (2^k, 1.25 x 2^k, 1.5 x 2^k, 1.75 x 2^k, rounded up to whole pages, and to
 * whole huge pages from HUGE_FROM_BYTES), so that requests of nearby sizes
 * share blocks and a block handed back is filed under the capacity it was
 * mapped with, knowing only the size it was asked for. The pages past a
 * request are never touched: they cost address space, not memory. 0 when
 * it overflows. */
static size_t capacity_of(size_t bytes) {
    size_t top = (size_t)1 << (63 - __builtin_clzll((unsigned long long)bytes));
    size_t unit = bytes >= HUGE_FROM_BYTES ? HUGE_PAGE_BYTES : cache.page_bytes;
    if (top / 4 > unit) unit = top / 4;
    if (bytes > SIZE_MAX - unit) return 0;
    return (bytes + unit - 1) / unit * unit;
}

/* Map a new block of `capacity` bytes (huge-page aligned when huge pages
 * are asked for); NULL when the system refuses. */
static void *map_block(size_t capacity) {
    int huge = capacity >= HUGE_FROM_BYTES;
    size_t slack = huge ? HUGE_PAGE_BYTES : 0;
    char *p =
        mmap(NULL, capacity + slack, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return NULL;
    if (!huge) return p;
    uintptr_t addr = (uintptr_t)p;
    uintptr_t aligned = (addr + HUGE_PAGE_BYTES - 1) & ~(uintptr_t)(HUGE_PAGE_BYTES - 1);
    size_t head = (size_t)(aligned - addr);
    if (head) munmap(p, head);
    if (slack - head) munmap((char *)aligned + capacity, slack - head);
#ifdef MADV_HUGEPAGE
    madvise((void *)aligned, capacity, MADV_HUGEPAGE); /* a hint: refused is fine */
#endif
    return (void *)aligned;
}

/* Unmap idle blocks, oldest first, until at most `keep` idle bytes remain.
 * Returns them in *out (at most n) for unmapping outside the lock; the
 * caller holds the lock. How many were taken. */
static size_t take_oldest(size_t keep, idle_t *out, size_t n) {
    size_t k = 0;
    while (cache.nidle && cache.stats.idle_bytes > keep && k < n) {
        idle_t *last = &cache.idle[--cache.nidle];
        cache.stats.idle_bytes -= last->capacity;
        cache.stats.unmapped++;
        out[k++] = *last;
    }
    return k;
}

static void unmap_all(idle_t *blocks, size_t n) {
    for (size_t i = 0; i < n; i++) munmap(blocks[i].block, blocks[i].capacity);
}

/* Evict down to `keep` idle bytes, unmapping outside the lock in batches.
 * Called without the lock. */
static void evict_to(size_t keep) {
    idle_t batch[32];
    size_t n;
    do {
        pthread_mutex_lock(&cache.mu);
        n = take_oldest(keep, batch, 32);
        pthread_mutex_unlock(&cache.mu);
        unmap_all(batch, n);
    } while (n == 32);
}

cring_status_t cring__result_block_get(size_t bytes, void **block_out) {
    pthread_once(&once, init_once);
    *block_out = NULL;
    size_t need = capacity_of(bytes ? bytes : 1);
    if (!need) return CRING_ERR_NO_MEMORY;
    pthread_mutex_lock(&cache.mu);
    size_t best = 0; /* the newest block of this capacity */
    while (best < cache.nidle && cache.idle[best].capacity != need) best++;
    if (best < cache.nidle) {
        idle_t got = cache.idle[best];
        memmove(cache.idle + best, cache.idle + best + 1,
                (cache.nidle - best - 1) * sizeof *cache.idle);
        cache.nidle--;
        cache.stats.idle_bytes -= got.capacity;
        cache.stats.lent_bytes += got.capacity;
        cache.stats.reused++;
        pthread_mutex_unlock(&cache.mu);
        *block_out = got.block;
        return CRING_OK;
    }
    pthread_mutex_unlock(&cache.mu);
    void *p = map_block(need);
    if (!p) { /* memory is short: give the idle blocks back, retry */
        cring__result_cache_trim();
        p = map_block(need);
    }
    if (!p) return CRING_ERR_NO_MEMORY;
    pthread_mutex_lock(&cache.mu);
    cache.stats.lent_bytes += need;
    cache.stats.mapped++;
    pthread_mutex_unlock(&cache.mu);
    *block_out = p;
    return CRING_OK;
}

void cring__result_block_put(void *block, size_t bytes) {
    if (!block) return;
    pthread_once(&once, init_once);
    size_t capacity = capacity_of(bytes ? bytes : 1);
    pthread_mutex_lock(&cache.mu);
    cache.stats.lent_bytes -= capacity;
    int keep = capacity <= cache.limit_bytes;
    if (keep && cache.nidle == cache.cap_idle) {
        size_t cap = cache.cap_idle ? 2 * cache.cap_idle : 16;
        idle_t *grown = realloc(cache.idle, cap * sizeof *grown);
        if (grown) {
            cache.idle = grown;
            cache.cap_idle = cap;
        } else {
            keep = 0;
        }
    }
    if (!keep) {
        cache.stats.unmapped++;
        pthread_mutex_unlock(&cache.mu);
        munmap(block, capacity);
        return;
    }
    memmove(cache.idle + 1, cache.idle, cache.nidle * sizeof *cache.idle);
    cache.idle[0] = (idle_t){block, capacity};
    cache.nidle++;
    cache.stats.idle_bytes += capacity;
    int over = cache.stats.idle_bytes > cache.limit_bytes;
    size_t limit = cache.limit_bytes;
    pthread_mutex_unlock(&cache.mu);
    if (over) evict_to(limit);
}

void cring__result_cache_configure(void) {
    pthread_once(&once, init_once);
    size_t limit = limit_from_env();
    pthread_mutex_lock(&cache.mu);
    cache.limit_bytes = limit;
    cache.stats.limit_bytes = limit;
    pthread_mutex_unlock(&cache.mu);
    evict_to(limit);
}

void cring__result_cache_trim(void) {
    pthread_once(&once, init_once);
    evict_to(0);
}

void cring__result_cache_stats(cring__result_cache_stats_t *out) {
    pthread_once(&once, init_once);
    pthread_mutex_lock(&cache.mu);
    *out = cache.stats;
    pthread_mutex_unlock(&cache.mu);
}
