/* shm.c: the shared-memory transport for ranks on one host: one mapped segment
 * with a control block and a data window per rank, progress counters with
 * spin-then-park waits (futex), peer-death and abort detection.
 * It moves no data itself and knows nothing of collectives or dtypes. */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "../common/auth.h"
#include "transport.h"

/* "CRNGSHM2": the header carries the algorithms' parameters since issue 35 */
#define SHM_MAGIC 0x43524e4753484d32ull
#define PAGE_BYTES 4096
/* A spinning waiter yields the core once every this many pauses (about
 * 0.7 us here): a peer usually answers a small collective within that, so
 * quiet runs rarely pay the system call, while a waiter whose peer shares
 * its core with another busy process (a data loader, say) no longer holds
 * the core for the whole spin budget. With a competing busy loop, an 8-byte
 * allreduce took 18-32 us without the yields, 4.6-5.9 us yielding every 256
 * pauses and 2.1-2.8 us every 64 (mpi4py: 2.7-3.2 us); quiet, 0.62-0.67 us
 * either way, and the 1 MiB and 64 MiB collectives did not move beyond
 * noise. */
#define SPIN_YIELD_EVERY 64

/* One rank's control block: the progress counter and its futex word on their
 * own cache line (written by the owner, read by everyone), the waiter count on
 * another (written by waiters), then the descriptor slots. */
typedef struct shm_ctrl {
    _Alignas(CRING_CACHE_LINE) _Atomic uint64_t seq;
    _Atomic uint32_t futex_word; /* low 32 bits of seq */
    _Alignas(CRING_CACHE_LINE) _Atomic uint32_t waiters;
    int32_t pid;
    _Atomic uint32_t left; /* set when this rank shut down cleanly (cring__shm_leave) */
    _Alignas(CRING_CACHE_LINE) _Atomic uint32_t bell; /* rung by peers and local threads */
    _Atomic uint32_t bell_sleepers;
    _Atomic uint64_t announced; /* last round this rank announced */
    _Atomic uint32_t driving;   /* a thread of this rank is running collectives */
    _Alignas(CRING_CACHE_LINE) unsigned char slots[2][CRING__SHM_SLOT_BYTES];
} shm_ctrl_t;

typedef struct shm_header {
    uint64_t magic;
    uint8_t nonce[CRING__NONCE_BYTES];
    uint64_t size;
    uint64_t window_bytes;
    uint64_t params[CRING__SHM_PARAMS]; /* rank 0's, for the algorithms */
    _Alignas(CRING_CACHE_LINE) _Atomic uint32_t aborted;
    /* who aborted and why: (detector + 1) | status << 16 | (peer + 1) << 32 */
    _Atomic uint64_t abort_info;
} shm_header_t;

struct cring__shm {
    int rank;
    int size;
    double timeout_s;
    cring__errmsg_t *err;
    void *base;
    size_t map_bytes;
    size_t window_bytes;
    shm_header_t *hdr;
    shm_ctrl_t *ctrl; /* size entries */
    unsigned char *windows;
    uint64_t my_seq;
    uint64_t params[CRING__SHM_PARAMS]; /* the header's, copied at creation */
    /* the highest counter value seen per peer (they only grow): a wait it
     * already covers needs no load of the peer's line, which the peer has
     * usually written again since (a cross-core miss per small collective) */
    _Atomic uint64_t *seen;
    long spin_iters;
    long yield_iters;
};

static size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

static size_t ctrl_offset(void) { return round_up(sizeof(shm_header_t), PAGE_BYTES); }
static size_t windows_offset(int size) {
    return round_up(ctrl_offset() + (size_t)size * sizeof(shm_ctrl_t), PAGE_BYTES);
}

static long futex_call(_Atomic uint32_t *addr, int op, uint32_t val, const struct timespec *ts) {
    return syscall(SYS_futex, (uint32_t *)addr, op, val, ts, NULL, 0);
}

static void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Is the process alive? A zombie counts as dead: it will never publish again. */
static int pid_alive(pid_t pid) {
    if (pid <= 0) return 1;
    if (kill(pid, 0) != 0 && errno == ESRCH) return 0;
    char path[64], buf[256];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f) return 1; /* no /proc: trust kill() */
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    const char *close_paren = strrchr(buf, ')');
    if (close_paren && close_paren[1] == ' ' && (close_paren[2] == 'Z' || close_paren[2] == 'X'))
        return 0;
    return 1;
}

static void choose_spin_policy(cring__shm_t *shm) {
    cpu_set_t set;
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    if (sched_getaffinity(0, sizeof set, &set) == 0) cpus = CPU_COUNT(&set);
    /* With more ranks than cores, a spinning waiter steals the core its peer
     * needs to make progress: spin little and yield early. */
    long dflt_spin = (cpus >= shm->size) ? 20000 : 200;
    shm->spin_iters = cring__env_long("CRING_SHM_SPIN", dflt_spin);
    shm->yield_iters = cring__env_long("CRING_SHM_YIELD", 64);
}

/* Rank 0: create, size and map the segment, fill the header. */
static cring_status_t create_segment(cring__shm_t *shm, char *name, size_t name_len) {
    uint8_t rnd[8];
    cring__random_bytes(rnd, sizeof rnd);
    snprintf(name, name_len, "/cring-%d-%02x%02x%02x%02x%02x%02x%02x%02x", (int)getpid(), rnd[0],
             rnd[1], rnd[2], rnd[3], rnd[4], rnd[5], rnd[6], rnd[7]);
    int fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0)
        return cring__fail(shm->err, CRING_ERR_SYSTEM, "shm_open(%s) failed: %s", name,
                           strerror(errno));
    cring_status_t st = CRING_OK;
    if (ftruncate(fd, (off_t)shm->map_bytes) != 0) {
        st =
            cring__fail(shm->err, CRING_ERR_SYSTEM, "cannot size shared memory %s to %zu bytes: %s",
                        name, shm->map_bytes, strerror(errno));
        goto cleanup;
    }
    shm->base = mmap(NULL, shm->map_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (shm->base == MAP_FAILED) {
        shm->base = NULL;
        st = cring__fail(shm->err, CRING_ERR_SYSTEM, "mmap of %zu bytes failed: %s", shm->map_bytes,
                         strerror(errno));
        goto cleanup;
    }
    shm->hdr = shm->base;
    shm->hdr->size = (uint64_t)shm->size;
    shm->hdr->window_bytes = shm->window_bytes;
    memcpy(shm->hdr->params, shm->params, sizeof shm->params);
    cring__random_bytes(shm->hdr->nonce, sizeof shm->hdr->nonce);
    shm->hdr->magic = SHM_MAGIC;
cleanup:
    close(fd);
    if (st != CRING_OK) shm_unlink(name);
    return st;
}

/* Other ranks: open and map rank 0's segment and prove it is the same one by
 * its nonce (a same-named file on another host or /dev/shm would differ). */
static cring_status_t open_segment(cring__shm_t *shm, const char *name,
                                   const uint8_t nonce[CRING__NONCE_BYTES]) {
    int fd = shm_open(name, O_RDWR, 0600);
    if (fd < 0)
        return cring__fail(shm->err, CRING_ERR_NOT_SUPPORTED,
                           "rank %d cannot open shared memory %s (%s): not on rank 0's host",
                           shm->rank, name, strerror(errno));
    cring_status_t st = CRING_OK;
    struct stat sb;
    if (fstat(fd, &sb) != 0 || (size_t)sb.st_size != shm->map_bytes) {
        st = cring__fail(shm->err, CRING_ERR_NOT_SUPPORTED,
                         "rank %d: shared memory %s has an unexpected size", shm->rank, name);
        goto cleanup;
    }
    shm->base = mmap(NULL, shm->map_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (shm->base == MAP_FAILED) {
        shm->base = NULL;
        st = cring__fail(shm->err, CRING_ERR_SYSTEM, "mmap of %zu bytes failed: %s", shm->map_bytes,
                         strerror(errno));
        goto cleanup;
    }
    shm->hdr = shm->base;
    if (shm->hdr->magic != SHM_MAGIC || memcmp(shm->hdr->nonce, nonce, CRING__NONCE_BYTES) ||
        shm->hdr->size != (uint64_t)shm->size)
        st = cring__fail(shm->err, CRING_ERR_NOT_SUPPORTED,
                         "rank %d: shared memory %s is not the segment rank 0 created "
                         "(another host or another /dev/shm)",
                         shm->rank, name);
cleanup:
    close(fd);
    return st;
}

/* Store record under <prefix>/shm/name: one status byte (1 ok, 0 failed),
 * the nonce, then the NUL-terminated name. */
cring_status_t cring__shm_create(const cring__transport_init_t *init, size_t window_bytes,
                                 cring__shm_t **out) {
    cring_status_t st = CRING_OK, try_st = CRING_OK;
    char name[96] = "", key[512];
    unsigned char record[1 + CRING__NONCE_BYTES + sizeof name];
    void *value = NULL;
    size_t len = 0;
    *out = NULL;
    cring__shm_t *shm = calloc(1, sizeof *shm);
    if (shm) shm->seen = calloc((size_t)init->size, sizeof *shm->seen);
    if (!shm || !shm->seen) {
        free(shm);
        return cring__fail(init->err, CRING_ERR_NO_MEMORY, "shm: out of memory");
    }
    shm->rank = init->rank;
    shm->size = init->size;
    shm->timeout_s = init->timeout_s;
    shm->err = init->err;
    shm->window_bytes = round_up(window_bytes, PAGE_BYTES);
    if (init->shm_params) memcpy(shm->params, init->shm_params, sizeof shm->params);
    shm->map_bytes = windows_offset(init->size) + (size_t)init->size * shm->window_bytes;
    choose_spin_policy(shm);
    snprintf(key, sizeof key, "%s/shm/name", init->key_prefix);

    if (init->rank == 0) {
        try_st = create_segment(shm, name, sizeof name);
        record[0] = try_st == CRING_OK;
        memcpy(record + 1, try_st == CRING_OK ? shm->hdr->nonce : (uint8_t[16]){0},
               CRING__NONCE_BYTES);
        memcpy(record + 1 + CRING__NONCE_BYTES, name, strlen(name) + 1);
        st = cring_store_set(init->store, key, record, 1 + CRING__NONCE_BYTES + strlen(name) + 1);
        if (st != CRING_OK) {
            if (try_st == CRING_OK) shm_unlink(name);
            cring__fail(init->err, st, "publishing the shared-memory name failed: %s",
                        cring__thread_errmsg()->text);
            goto cleanup;
        }
    } else {
        st = cring_store_get(init->store, key, init->timeout_s, &value, &len);
        if (st != CRING_OK) {
            cring__fail(init->err, st, "rank %d: waiting for the shared-memory name failed: %s",
                        init->rank, cring__thread_errmsg()->text);
            goto cleanup;
        }
        const unsigned char *rec = value;
        if (len < 2 + CRING__NONCE_BYTES || len > sizeof record || rec[len - 1] != 0) {
            st = cring__fail(init->err, CRING_ERR_PROTOCOL, "malformed shared-memory record");
            goto cleanup;
        }
        memcpy(name, rec + 1 + CRING__NONCE_BYTES, len - 1 - CRING__NONCE_BYTES);
        try_st = rec[0] ? open_segment(shm, name, rec + 1)
                        : cring__fail(init->err, CRING_ERR_NOT_SUPPORTED,
                                      "rank 0 could not create the shared memory");
    }
    if (try_st == CRING_OK) {
        shm->ctrl = (shm_ctrl_t *)((unsigned char *)shm->base + ctrl_offset());
        shm->windows = (unsigned char *)shm->base + windows_offset(init->size);
        shm->ctrl[init->rank].pid = (int32_t)getpid();
        memcpy(shm->params, shm->hdr->params, sizeof shm->params); /* rank 0's */
        /* Touch this rank's window so page faults are not paid in a collective. */
        memset(shm->windows + (size_t)init->rank * shm->window_bytes, 0, shm->window_bytes);
    }

    /* Every rank has tried (and mapped, or failed): the last rank to try and
     * rank 0 both remove the name (whichever comes second finds it gone), so
     * nothing outlives the job even if rank 0 dies in between. */
    int64_t tried = 0;
    snprintf(key, sizeof key, "%s/shm/tried", init->key_prefix);
    st = cring_store_add(init->store, key, 1, &tried);
    if (st == CRING_OK && tried == init->size) {
        if (name[0]) shm_unlink(name);
        snprintf(key, sizeof key, "%s/shm/all_tried", init->key_prefix);
        st = cring_store_set(init->store, key, "1", 1);
    }
    if (init->rank == 0 && name[0]) {
        if (st == CRING_OK) {
            const char *keys[1] = {key};
            snprintf(key, sizeof key, "%s/shm/all_tried", init->key_prefix);
            st = cring_store_wait(init->store, keys, 1, init->timeout_s);
        }
        shm_unlink(name);
    }
    if (st != CRING_OK) {
        cring__fail(init->err, st, "shared-memory rendezvous failed: %s",
                    cring__thread_errmsg()->text);
        goto cleanup;
    }
    st = try_st;

cleanup:
    free(value);
    if (st != CRING_OK) {
        cring__shm_destroy(shm);
        return st;
    }
    *out = shm;
    return CRING_OK;
}

void cring__shm_destroy(cring__shm_t *shm) {
    if (!shm) return;
    if (shm->base) munmap(shm->base, shm->map_bytes);
    free(shm->seen);
    free(shm);
}

void *cring__shm_window(cring__shm_t *shm, int peer) {
    return shm->windows + (size_t)peer * shm->window_bytes;
}

size_t cring__shm_window_bytes(const cring__shm_t *shm) { return shm->window_bytes; }

const uint64_t *cring__shm_params(const cring__shm_t *shm) { return shm->params; }

void *cring__shm_slot(cring__shm_t *shm, int peer, int index) {
    return shm->ctrl[peer].slots[index & 1];
}

uint64_t cring__shm_seq(const cring__shm_t *shm) { return shm->my_seq; }

void cring__shm_publish(cring__shm_t *shm, uint64_t seq) {
    shm_ctrl_t *me = &shm->ctrl[shm->rank];
    shm->my_seq = seq;
    atomic_store_explicit(&me->seq, seq, memory_order_release);
    atomic_store_explicit(&me->futex_word, (uint32_t)seq, memory_order_release);
    /* Pairs with the waiter's fence between raising `waiters` and re-reading
     * the counter: either it sees the new value or we see it waiting. */
    atomic_thread_fence(memory_order_seq_cst);
    if (atomic_load_explicit(&me->waiters, memory_order_relaxed) != 0)
        futex_call(&me->futex_word, FUTEX_WAKE, INT_MAX, NULL);
}

#define ABORT_PEER_LEFT (1ull << 24) /* abort_info: the peer shut down, it did not die */

static void abort_job(cring__shm_t *shm, cring_status_t why, int peer, uint64_t extra) {
    if (!shm || !shm->hdr) return;
    uint64_t info = (uint64_t)(shm->rank + 1) | (uint64_t)(uint8_t)(-(int)why) << 16 |
                    (uint64_t)(uint32_t)(peer + 1) << 32 | extra;
    uint64_t none = 0;
    atomic_compare_exchange_strong(&shm->hdr->abort_info, &none, info); /* the first reason wins */
    atomic_store(&shm->hdr->aborted, 1);
    for (int r = 0; r < shm->size; r++) {
        atomic_fetch_add(&shm->ctrl[r].futex_word, 0x80000000u); /* change the word */
        futex_call(&shm->ctrl[r].futex_word, FUTEX_WAKE, INT_MAX, NULL);
        cring__shm_ring(shm, r);
    }
}

void cring__shm_abort(cring__shm_t *shm, cring_status_t why, int peer) {
    abort_job(shm, why, peer, 0);
}

void cring__shm_leave(cring__shm_t *shm) {
    if (!shm || !shm->hdr) return;
    atomic_store(&shm->ctrl[shm->rank].left, 1);
    shm_ctrl_t *me = &shm->ctrl[shm->rank];
    atomic_fetch_add(&me->futex_word, 0x80000000u); /* wake whoever waits for this rank */
    futex_call(&me->futex_word, FUTEX_WAKE, INT_MAX, NULL);
}

void cring__shm_ring(cring__shm_t *shm, int peer) {
    shm_ctrl_t *c = &shm->ctrl[peer];
    atomic_fetch_add(&c->bell, 1);
    if (atomic_load(&c->bell_sleepers) != 0) futex_call(&c->bell, FUTEX_WAKE, INT_MAX, NULL);
}

uint32_t cring__shm_bell(const cring__shm_t *shm) {
    return atomic_load(&shm->ctrl[shm->rank].bell);
}

void cring__shm_idle_wait(cring__shm_t *shm, uint32_t seen, double max_wait_s) {
    shm_ctrl_t *me = &shm->ctrl[shm->rank];
    if (max_wait_s <= 0) return;
    struct timespec ts = {(time_t)max_wait_s,
                          (long)((max_wait_s - (double)(time_t)max_wait_s) * 1e9)};
    atomic_fetch_add(&me->bell_sleepers, 1);
    /* Pairs with the ringer's fetch_add then load of bell_sleepers. */
    if (atomic_load(&me->bell) == seen && !atomic_load(&shm->hdr->aborted))
        futex_call(&me->bell, FUTEX_WAIT, seen, &ts);
    atomic_fetch_sub(&me->bell_sleepers, 1);
}

void cring__shm_announce(cring__shm_t *shm, uint64_t round) {
    atomic_store(&shm->ctrl[shm->rank].announced, round);
}

void cring__shm_set_driving(cring__shm_t *shm, int on) {
    atomic_store(&shm->ctrl[shm->rank].driving, on ? 1u : 0u);
}

/* A rank we wait for whose threads are all idle needs its bell rung. */
static void poke_if_idle(cring__shm_t *shm, int peer) {
    if (!atomic_load(&shm->ctrl[peer].driving)) cring__shm_ring(shm, peer);
}

uint64_t cring__shm_peer_announced(const cring__shm_t *shm) {
    uint64_t best = 0;
    for (int r = 0; r < shm->size; r++) {
        if (r == shm->rank) continue;
        uint64_t a = atomic_load(&shm->ctrl[r].announced);
        if (a > best) best = a;
    }
    return best;
}

static int reached(const shm_ctrl_t *c, uint64_t seq) {
    return atomic_load_explicit(&c->seq, memory_order_acquire) >= seq;
}

/* reached(), remembering what it saw in shm->seen[peer]. */
static int reached_peer(cring__shm_t *shm, int peer, uint64_t seq) {
    uint64_t v = atomic_load_explicit(&shm->ctrl[peer].seq, memory_order_acquire);
    if (v > atomic_load_explicit(&shm->seen[peer], memory_order_relaxed))
        atomic_store_explicit(&shm->seen[peer], v, memory_order_relaxed);
    return v >= seq;
}

/* Another rank aborted: report its reason, so every survivor raises the
 * same kind of error (a dead peer is a peer failure everywhere). */
static cring_status_t aborted_status(cring__shm_t *shm) {
    uint64_t info = atomic_load(&shm->hdr->abort_info);
    int detector = (int)(info & 0xffff) - 1;
    cring_status_t why = (cring_status_t) - (int)((info >> 16) & 0xff);
    int peer = (int)(uint32_t)(info >> 32) - 1;
    if (why == CRING_ERR_PEER_FAILURE && peer >= 0 && (info & ABORT_PEER_LEFT))
        return cring__fail(shm->err, CRING_ERR_PEER_FAILURE,
                           "rank %d left (shut down) (rank %d noticed first; rank %d stopped)",
                           peer, detector, shm->rank);
    if (why == CRING_ERR_PEER_FAILURE && peer >= 0)
        return cring__fail(shm->err, CRING_ERR_PEER_FAILURE,
                           "rank %d died (rank %d noticed first; rank %d stopped)", peer, detector,
                           shm->rank);
    if (why == CRING_ERR_TIMEOUT && peer >= 0)
        return cring__fail(shm->err, CRING_ERR_TIMEOUT,
                           "rank %d timed out waiting for rank %d (CRING_TIMEOUT_SECONDS); rank "
                           "%d stopped too",
                           detector, peer, shm->rank);
    /* Otherwise the peer is not a rank of this segment (hierarchical: it is
     * on another host) or was not recorded: a peer failure or a time-out
     * keeps its kind all the same. */
    if (detector >= 0)
        return cring__fail(
            shm->err,
            why == CRING_ERR_PEER_FAILURE || why == CRING_ERR_TIMEOUT ? why : CRING_ERR_BROKEN,
            "rank %d stopped: rank %d hit an error (%s) and aborted the job's "
            "collectives",
            shm->rank, detector, cring_status_string(why));
    return cring__fail(shm->err, CRING_ERR_BROKEN, "the shared-memory communicator was aborted");
}

void cring__shm_relax(long i) {
    if ((i & (SPIN_YIELD_EVERY - 1)) == SPIN_YIELD_EVERY - 1) sched_yield();
    else cpu_relax();
}

/* Spin cap of the calling thread (-1: none); see cring__shm_cap_thread_spin. */
static _Thread_local long thread_spin_cap = -1;

void cring__shm_cap_thread_spin(long iters) { thread_spin_cap = iters; }

cring_status_t cring__shm_wait(cring__shm_t *shm, int peer, uint64_t seq) {
    shm_ctrl_t *c = &shm->ctrl[peer];
    /* the acquire load that saw the value synchronised already */
    if (atomic_load_explicit(&shm->seen[peer], memory_order_relaxed) >= seq) return CRING_OK;
    if (reached_peer(shm, peer, seq)) return CRING_OK;
    long spin = shm->spin_iters;
    if (thread_spin_cap >= 0 && thread_spin_cap < spin) spin = thread_spin_cap;
    for (long i = 0; i < spin; i++) {
        cring__shm_relax(i);
        if (reached_peer(shm, peer, seq)) return CRING_OK;
    }
    poke_if_idle(shm, peer);
    for (long i = 0; i < shm->yield_iters; i++) {
        sched_yield();
        if (reached(c, seq)) return CRING_OK;
    }
    double start = cring__now_s(), next_liveness = start + 0.1;
    long slice_ns = 50 * 1000; /* doubles up to 20 ms: prompt re-pokes first */
    for (;;) {
        struct timespec slice = {0, slice_ns};
        if (slice_ns < 20 * 1000 * 1000) slice_ns *= 2;
        atomic_fetch_add(&c->waiters, 1);
        atomic_thread_fence(memory_order_seq_cst);
        uint32_t word = atomic_load(&c->futex_word);
        if (!reached(c, seq) && !atomic_load(&shm->hdr->aborted))
            futex_call(&c->futex_word, FUTEX_WAIT, word, &slice);
        atomic_fetch_sub(&c->waiters, 1);
        if (reached(c, seq)) return CRING_OK;
        if (atomic_load(&shm->hdr->aborted)) return aborted_status(shm);
        if (atomic_load(&c->left)) { /* it shut down cleanly: it will never come */
            abort_job(shm, CRING_ERR_PEER_FAILURE, peer, ABORT_PEER_LEFT);
            return cring__fail(shm->err, CRING_ERR_PEER_FAILURE,
                               "rank %d left (shut down) while rank %d was waiting for it", peer,
                               shm->rank);
        }
        poke_if_idle(shm, peer);
        double now = cring__now_s();
        if (now >= next_liveness) {
            next_liveness = now + 0.1;
            if (!pid_alive(c->pid)) {
                cring__shm_abort(shm, CRING_ERR_PEER_FAILURE, peer);
                return cring__fail(shm->err, CRING_ERR_PEER_FAILURE,
                                   "rank %d (pid %d) died while rank %d was waiting for it", peer,
                                   (int)c->pid, shm->rank);
            }
        }
        if (now - start > shm->timeout_s) {
            cring__shm_abort(shm, CRING_ERR_TIMEOUT, peer);
            return cring__fail(shm->err, CRING_ERR_TIMEOUT,
                               "rank %d waited %.1f s for rank %d (CRING_TIMEOUT_SECONDS=%g); "
                               "it never reached the same collective",
                               shm->rank, now - start, peer, shm->timeout_s);
        }
    }
}

void cring__shm_saw(cring__shm_t *shm, int peer, uint64_t seq) {
    if (seq > atomic_load_explicit(&shm->seen[peer], memory_order_relaxed))
        atomic_store_explicit(&shm->seen[peer], seq, memory_order_relaxed);
}

uint64_t cring__shm_flag_key(const cring__shm_t *shm) {
    uint64_t key;
    memcpy(&key, shm->hdr->nonce, sizeof key);
    return key;
}

long cring__shm_spin_limit(const cring__shm_t *shm) {
    return thread_spin_cap >= 0 && thread_spin_cap < shm->spin_iters ? thread_spin_cap
                                                                     : shm->spin_iters;
}

cring_status_t cring__shm_wait_all(cring__shm_t *shm, uint64_t seq) {
    for (int r = 0; r < shm->size; r++) {
        if (r == shm->rank) continue;
        CRING_CHECK(cring__shm_wait(shm, r, seq));
    }
    return CRING_OK;
}
