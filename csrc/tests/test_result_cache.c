/* test_result_cache.c: the process-wide cache of large result blocks
 * (common/result_cache.c): a block handed back is what the next request of a
 * close size gets, a lent block is never handed out twice, the idle bytes
 * never exceed CRING_RESULT_CACHE_BYTES (0 keeps nothing), trim gives every
 * idle block back, and threads taking, writing and handing back blocks at
 * once never share one. */
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include "common/result_cache.h"
#include "testutil.h"

#define MIB ((size_t)1 << 20)

static cring__result_cache_stats_t stats(void) {
    cring__result_cache_stats_t st;
    cring__result_cache_stats(&st);
    return st;
}

static void *get(size_t bytes) {
    void *p = NULL;
    CHECK_OK(cring__result_block_get(bytes, &p));
    CHECK(p != NULL);
    memset(p, 0x5a, bytes); /* every byte is writable */
    return p;
}

static void set_limit(const char *bytes) {
    setenv("CRING_RESULT_CACHE_BYTES", bytes, 1);
    cring__result_cache_configure();
}

static void reuse_and_fit(void) {
    set_limit("67108864"); /* 64 MiB */
    cring__result_cache_trim();
    void *a = get(3 * MIB);
    CHECK(((uintptr_t)a & 4095) == 0); /* page-aligned */
    void *big = get(8 * MIB);
    CHECK(((uintptr_t)big & (2 * MIB - 1)) == 0); /* huge-page aligned from 4 MiB */
    cring__result_block_put(a, 3 * MIB);
    CHECK(stats().idle_bytes == 3 * MIB);
    /* the same size and one of the same size class (2.5 to 3 MiB) reuse it;
     * a smaller or a larger one does not */
    void *b = get(3 * MIB - 100);
    CHECK(b == a);
    cring__result_block_put(b, 3 * MIB - 100);
    b = get(2 * MIB + MIB / 2 + 1);
    CHECK(b == a);
    cring__result_block_put(b, 2 * MIB + MIB / 2 + 1);
    b = get(2 * MIB + MIB / 2);
    CHECK(b != a);
    cring__result_block_put(b, 2 * MIB + MIB / 2);
    cring__result_block_put(get(3 * MIB), 3 * MIB); /* a back to the front */
    void *c = get(MIB);
    CHECK(c != a);
    void *d = get(4 * MIB);
    CHECK(d != a);
    CHECK(stats().idle_bytes == 3 * MIB + 2 * MIB + MIB / 2);
    /* two lent blocks are never the same */
    void *e = get(3 * MIB);
    void *f = get(3 * MIB);
    CHECK(e == a && f != e);
    cring__result_block_put(c, MIB);
    cring__result_block_put(d, 4 * MIB);
    cring__result_block_put(e, 3 * MIB);
    cring__result_block_put(f, 3 * MIB);
    cring__result_block_put(big, 8 * MIB);
    CHECK(stats().lent_bytes == 0);
    CHECK(stats().idle_bytes == MIB + 4 * MIB + 6 * MIB + 8 * MIB + 2 * MIB + MIB / 2);
    /* of two idle 3 MiB blocks and a 4 MiB one, a 3 MiB request gets the
     * newest 3 MiB one */
    void *g = get(3 * MIB);
    CHECK(g == f);
    cring__result_block_put(g, 3 * MIB);
    cring__result_block_put(NULL, MIB); /* nothing */
    cring__result_cache_trim();
    CHECK(stats().idle_bytes == 0 && stats().lent_bytes == 0);
}

/* The idle bytes stay within the limit, the oldest going first; a block
 * over the limit is never kept; 0 keeps nothing. */
static void limit(void) {
    set_limit("10485760"); /* 10 MiB */
    CHECK(stats().limit_bytes == 10 * MIB);
    void *blocks[6];
    for (int i = 0; i < 6; i++) blocks[i] = get(2 * MIB);
    uint64_t unmapped = stats().unmapped;
    for (int i = 0; i < 6; i++) cring__result_block_put(blocks[i], 2 * MIB);
    CHECK(stats().idle_bytes == 10 * MIB);
    CHECK(stats().unmapped == unmapped + 1);
    void *again = get(2 * MIB); /* the newest, blocks[5] */
    CHECK(again == blocks[5]);
    cring__result_block_put(again, 2 * MIB);
    void *huge = get(12 * MIB);
    cring__result_block_put(huge, 12 * MIB); /* larger than the limit: unmapped */
    CHECK(stats().idle_bytes == 10 * MIB);
    set_limit("4194304"); /* lowering the limit gives the excess back at once */
    CHECK(stats().idle_bytes == 4 * MIB);
    set_limit("0");
    CHECK(stats().idle_bytes == 0);
    void *a = get(2 * MIB);
    cring__result_block_put(a, 2 * MIB);
    CHECK(stats().idle_bytes == 0);
    unsetenv("CRING_RESULT_CACHE_BYTES");
    cring__result_cache_configure();
    CHECK(stats().limit_bytes == CRING_RESULT_CACHE_DEFAULT_BYTES);
}

/* Threads take blocks of a few sizes, fill them with their own pattern,
 * check the pattern after the others ran, and hand them back: a block lent
 * twice at once shows as a foreign pattern. */
#define THREADS 4
#define ITERS 400
static void *hammer(void *arg) {
    int id = (int)(intptr_t)arg;
    unsigned seed = (unsigned)id * 7919u + 1;
    void *held[3] = {0};
    size_t held_bytes[3] = {0};
    for (int it = 0; it < ITERS; it++) {
        int slot = it % 3;
        if (held[slot]) {
            unsigned char *p = held[slot];
            for (size_t off = 0; off < held_bytes[slot]; off += 4096)
                if (p[off] != (unsigned char)(id + 1)) return (void *)1;
            cring__result_block_put(held[slot], held_bytes[slot]);
        }
        seed = seed * 1103515245u + 12345u;
        size_t bytes = MIB + (size_t)((seed >> 16) % 4) * MIB / 2;
        if (cring__result_block_get(bytes, &held[slot]) != CRING_OK) return (void *)2;
        held_bytes[slot] = bytes;
        memset(held[slot], id + 1, bytes);
    }
    for (int slot = 0; slot < 3; slot++) cring__result_block_put(held[slot], held_bytes[slot]);
    return NULL;
}

static void threads(void) {
    set_limit("16777216"); /* 16 MiB: both reuse and eviction happen */
    uint64_t reused = stats().reused;
    pthread_t t[THREADS];
    for (int i = 0; i < THREADS; i++)
        CHECK(pthread_create(&t[i], NULL, hammer, (void *)(intptr_t)i) == 0);
    for (int i = 0; i < THREADS; i++) {
        void *rc;
        CHECK(pthread_join(t[i], &rc) == 0);
        CHECK(rc == NULL);
    }
    CHECK(stats().lent_bytes == 0);
    CHECK(stats().idle_bytes <= 16 * MIB);
    CHECK(stats().reused > reused + 100);
    cring__result_cache_trim();
}

int main(void) {
    alarm(120);
    reuse_and_fit();
    limit();
    threads();
    TEST_DONE("test_result_cache");
    return 0;
}
