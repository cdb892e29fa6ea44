/* engine.c: the background engine's frame. Requests are queued by any
 * thread; one driving thread at a time (the engine thread, or a thread
 * waiting on its own handle) runs negotiation rounds (negotiate.c) with the
 * other ranks. This file owns the queue and submission, who drives and when,
 * waiting on a handle, start and stop, the statistics and the timeline hook.
 * It never touches sockets, shared memory, tensor data or the negotiation's
 * tables. */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../common/result_cache.h"
#include "engine_internal.h"
#include "engine_tools.h"

#define DEFAULT_FUSION_THRESHOLD (64u << 20)
#define DEFAULT_CACHE_CAPACITY 1024

static _Thread_local char submit_error[CRING__ERRMSG_BYTES];

const char *cring_engine_error_message(void) { return submit_error; }

cring_status_t cring__engine_submit_fail(cring_status_t st, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(submit_error, sizeof submit_error, fmt, ap);
    va_end(ap);
    return st;
}

cring_status_t cring_engine_submit(cring_engine_t *e, const cring_request_t *q,
                                   cring_handle_t **handle_out) {
    *handle_out = NULL;
    submit_error[0] = 0;
    /* The cause's status (peer failure, time-out), so a submission after a
     * peer left raises what the pending collectives raised. */
    if (atomic_load(&e->broken) != CRING_OK)
        return cring__engine_submit_fail((cring_status_t)atomic_load(&e->broken),
                                         "the engine failed earlier: %s", e->broken_msg);
    CRING_CHECK(cring__req_validate(e, q));
    req_t *r = cring__req_make(e, q, e->size);
    cring_handle_t *h = atomic_exchange(&e->spare.handle, NULL);
    if (!h) h = cring__pool_take(&e->spare.handles);
    if (h) memset(h, 0, sizeof *h);
    else h = calloc(1, sizeof *h);
    if (!r || !h) {
        cring__req_free(r);
        free(h);
        return cring__engine_submit_fail(CRING_ERR_NO_MEMORY, "out of memory");
    }
    const cring__backend_t *be = e->backends[r->device.type];
    if (be->prepare) {
        cring_status_t st = be->prepare(e, r);
        if (st != CRING_OK) {
            cring__req_free(r);
            free(h);
            return st;
        }
    }
    h->ntensors = q->ntensors;
    h->size = e->size;
    h->value = -1;
    h->engine = e;
    atomic_store(&h->refs, 2);
    r->handle = h;
    h->req = r;
    /* the coarse clock is cheaper but lags: the timeline needs the precise one */
    r->submit_s = atomic_load(&e->timeline_on) ? cring__now_s() : cring__now_coarse_s();
    pthread_mutex_lock(&e->queue.mu);
    if (atomic_load(&e->stop)) { /* checked under the lock: stop drains the queue after */
        pthread_mutex_unlock(&e->queue.mu);
        cring__req_free(r);
        free(h);
        return cring__engine_submit_fail(CRING_ERR_CLOSED, "cring has been shut down");
    }
    if (atomic_load(&e->join.in_flight)) {
        pthread_mutex_unlock(&e->queue.mu);
        cring__req_free(r);
        free(h);
        return cring__engine_submit_fail(
            CRING_ERR_INVALID_ARGUMENT,
            "rank %d has called join(): no collective may be submitted until "
            "join() returns",
            e->rank);
    }
    req_t *same = cring__strmap_get_h(&e->queue.in_flight, r->name, r->name_hash);
    if (same && (q->flags & CRING_REQUEST_SEQUENCED)) { /* wait behind it (name_done) */
        while (same->successor) same = same->successor;
        same->successor = r;
        atomic_fetch_add(&e->refs, 1);
        pthread_mutex_unlock(&e->queue.mu);
        *handle_out = h;
        return CRING_OK;
    }
    if (same) {
        pthread_mutex_unlock(&e->queue.mu);
        cring_status_t st =
            cring__engine_submit_fail(CRING_ERR_INVALID_ARGUMENT,
                                      "a request named '%s' is already in flight on rank %d; "
                                      "names must be unique until synchronized",
                                      r->name, e->rank);
        cring__req_free(r);
        free(h);
        return st;
    }
    if (cring__strmap_put_borrowed_h(&e->queue.in_flight, r->name, r->name_hash, r) != 0) {
        pthread_mutex_unlock(&e->queue.mu);
        cring__req_free(r);
        free(h);
        return cring__engine_submit_fail(CRING_ERR_NO_MEMORY, "out of memory");
    }
    atomic_fetch_add(&e->refs, 1);
    if (r->coll == CRING_COLL_JOIN) atomic_store(&e->join.in_flight, 1);
    if (e->queue.tail) e->queue.tail->next = r;
    else e->queue.head = r;
    e->queue.tail = r;
    pthread_mutex_unlock(&e->queue.mu);
    if (!(q->flags & CRING_REQUEST_CALLER_WAITS)) cring__comm_wake(e->comm);
    *handle_out = h;
    return CRING_OK;
}

void cring__engine_name_done(cring_engine_t *e, req_t *r, cring_status_t st, const char *error) {
    pthread_mutex_lock(&e->queue.mu);
    cring__strmap_remove_h(&e->queue.in_flight, r->name, r->name_hash);
    req_t *next = r->successor;
    r->successor = NULL;
    int stopping = atomic_load(&e->stop) || atomic_load(&e->broken) != CRING_OK;
    if (next && !stopping) {
        if (cring__strmap_put_borrowed_h(&e->queue.in_flight, next->name, next->name_hash, next) !=
            0) {
            stopping = 1; /* out of memory: fail it below rather than lose it */
            st = CRING_ERR_NO_MEMORY;
            error = "out of memory";
        } else {
            next->next = NULL;
            if (e->queue.tail) e->queue.tail->next = next;
            else e->queue.head = next;
            e->queue.tail = next;
        }
    }
    pthread_mutex_unlock(&e->queue.mu);
    if (!next) return;
    if (stopping) { /* nothing will run it: it ends the way the engine did */
        if (st == CRING_OK && atomic_load(&e->broken) != CRING_OK) {
            st = (cring_status_t)atomic_load(&e->broken);
            error = e->broken_msg;
        } else if (st == CRING_OK) {
            st = CRING_ERR_CLOSED;
            error = "cring was shut down before this request completed";
        }
        cring__engine_complete(e, next, st, error);
        cring__req_free(next);
        return;
    }
    cring__comm_wake(e->comm); /* the engine thread may be the one to run it */
}

void cring__engine_span_write(cring_engine_t *e, const char *name, const char *phase, double t0,
                              double t1, const char *args) {
    pthread_mutex_lock(&e->timeline_mu);
    cring__timeline_span(e->timeline, name, phase, t0, t1, args);
    pthread_mutex_unlock(&e->timeline_mu);
}

/* "allreduce" -> "ALLREDUCE" (Horovod's event names are upper case). */
static void upper_op(cring_collective_t c, char *out, size_t n) {
    const char *s = cring_collective_name(c);
    size_t i = 0;
    for (; s[i] && i + 1 < n; i++) out[i] = (char)(s[i] >= 'a' && s[i] <= 'z' ? s[i] - 32 : s[i]);
    out[i] = 0;
}

void cring__engine_span_negotiated(cring_engine_t *e, const req_t *r, double t_ready) {
    char phase[48] = "NEGOTIATE_";
    upper_op(r->coll, phase + 10, sizeof phase - 10);
    pthread_mutex_lock(&e->timeline_mu);
    cring__timeline_tensor(e->timeline, r->name, cring_collective_name(r->coll));
    cring__timeline_span(e->timeline, r->name, phase, r->submit_s, t_ready, NULL);
    pthread_mutex_unlock(&e->timeline_mu);
}

void cring__engine_span_done(cring_engine_t *e, const req_t *r) {
    /* barrier and join write their own top-level span; a request that never
     * became ready has no processing to show */
    if (r->coll == CRING_COLL_BARRIER || r->coll == CRING_COLL_JOIN || r->ready_s <= 0) return;
    char phase[40], args[128];
    upper_op(r->coll, phase, sizeof phase);
    size_t bytes = 0;
    for (int i = 0; i < r->ntensors; i++) bytes += r->t[i].bytes;
    snprintf(args, sizeof args, "\"dtype\": \"%s\", \"tensors\": %d, \"bytes\": %zu",
             r->ntensors ? cring_dtype_name(r->t[0].dtype) : "", r->ntensors, bytes);
    cring__engine_span_write(e, r->name, phase, r->ready_s, cring__now_s(), args);
}

void cring__engine_mark_cycle(cring_engine_t *e) {
    pthread_mutex_lock(&e->timeline_mu);
    cring__timeline_marker(e->timeline, "CYCLE_START", cring__now_s());
    pthread_mutex_unlock(&e->timeline_mu);
}

cring_status_t cring__engine_transport_failed(cring_engine_t *e, cring_status_t st) {
    int expected = CRING_OK;
    if (atomic_compare_exchange_strong(&e->broken, &expected, (int)st)) {
        /* A failure of this rank's own (out of memory): the communicator still
         * works, and the peers would wait for this rank until their time-out.
         * Abort it, so they stop at once with this rank's reason. */
        if (cring__comm_broken(e->comm) == CRING_OK)
            cring__comm_abort(e->comm, st,
                              e->exec.error[0] ? e->exec.error : cring_status_string(st));
        snprintf(e->broken_msg, sizeof e->broken_msg, "%s", cring__comm_error(e->comm));
        for (int t = 0; t < CRING__DEVICE_TYPES; t++)
            if (e->backends[t] && e->backends[t]->abort)
                e->backends[t]->abort(e, st, e->broken_msg);
    }
    cring__negotiate_fail_all(e, st, e->broken_msg);
    return st;
}

/* ---- driving ------------------------------------------------------------------------------- */

/* Run rounds while this rank has work or a peer waits for it. With `until`,
 * return as soon as that handle is done; with deadline_s > 0, once
 * cring__now_coarse_s() passes it (between rounds). Called with progress_mu held. */
static void drive(cring_engine_t *e, cring_handle_t *until, double deadline_s) {
    for (int first = 1;; first = 0) {
        /* Not on the first pass: a wait that finishes in one round pays no clock read. */
        if (deadline_s > 0 && !first && cring__now_coarse_s() >= deadline_s) return;
        if (atomic_load(&e->broken) != CRING_OK) {
            cring__negotiate_fail_all(e, (cring_status_t)atomic_load(&e->broken), e->broken_msg);
            return;
        }
        if (atomic_load(&e->stop)) return;
        if (until && atomic_load(&until->done)) return; /* before drain: it takes queue_mu */
        if (!until && atomic_load(&e->drive.callers_waiting)) return; /* let them drive */
        uint64_t token = cring__comm_wake_token(e->comm);
        cring__engine_drain(e);
        if (until && atomic_load(&until->done)) return;
        int local = e->neg.pending.count > 0 || e->join.req != NULL || e->bucket.plan.nheld > 0;
        if (!local && !cring__comm_peer_waiting(e->comm, e->drive.rounds_done)) return;
        int progress = 0;
        if (cring__negotiate_round(e, &progress) != CRING_OK) continue;
        /* The engine thread paces its rounds by CRING_CYCLE_TIME while
         * asynchronous work keeps arriving, so what arrives together is
         * fused (Horovod's cycle); a thread waiting on its own handle never
         * waits for this timer. */
        if (!until && e->drive.cycle_time_s > 0 && !atomic_load(&e->drive.callers_waiting) &&
            (e->neg.pending.count > 0 || e->queue.head != NULL)) {
            struct timespec ts = {
                (time_t)e->drive.cycle_time_s,
                (long)((e->drive.cycle_time_s - (double)(time_t)e->drive.cycle_time_s) * 1e9)};
            nanosleep(&ts, NULL);
            continue;
        }
        if (!progress && local && !cring__comm_peer_waiting(e->comm, e->drive.rounds_done) &&
            !(until && atomic_load(&until->done)))
            cring__comm_idle_wait(e->comm, token, e->drive.cycle_time_s);
    }
}

/* Run rounds as this rank's driver (progress_mu held). */
static void drive_locked(cring_engine_t *e, cring_handle_t *until, double deadline_s) {
    if (atomic_load(&e->stop)) return;
    cring__comm_set_driving(e->comm, 1);
    e->drive.until = until; /* bucket.c: a waiter on a held bucket asks for its release */
    drive(e, until, deadline_s);
    e->drive.until = NULL;
    /* A peer that announced a round we did not serve rings our bell once its
     * spin runs out (see poke_if_idle in shm.c), so leaving never strands
     * it, and a fast peer does not make us hand rounds to the engine thread. */
    cring__comm_set_driving(e->comm, 0);
}

/* The engine thread takes the driver's role only if it is free. */
static int try_drive(cring_engine_t *e);

/* Another thread of this rank is driving: over TCP, the peers' data is
 * readable the whole time it runs, and waiting on the sockets would spin.
 * Park until that driver leaves (it wakes us; see cring_handle_wait) or the
 * time-out, then look again. The flag is set before the second trylock, so a
 * driver that left in between is either seen by the trylock or sees the flag. */
static void park_while_busy(cring_engine_t *e, uint64_t token) {
    atomic_store(&e->drive.thread_parked, 1);
    if (!try_drive(e)) cring__comm_idle_wait_local(e->comm, token, 0.5);
    atomic_store(&e->drive.thread_parked, 0);
}

static int try_drive(cring_engine_t *e) {
    if (pthread_mutex_trylock(&e->drive.mu) != 0) return 0;
    drive_locked(e, NULL, 0);
    pthread_mutex_unlock(&e->drive.mu);
    return 1;
}

static void wait_done_cv(cring_engine_t *e, const cring_handle_t *h, long ns) {
    pthread_mutex_lock(&e->done.mu);
    atomic_fetch_add(&e->done.waiters, 1);
    if (!h || !atomic_load(&((cring_handle_t *)h)->done)) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += ns;
        while (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&e->done.cv, &e->done.mu, &ts);
    }
    atomic_fetch_sub(&e->done.waiters, 1);
    pthread_mutex_unlock(&e->done.mu);
}

/* The engine thread drives only when something asks it to: a local async
 * submission, or a peer that waited for this rank past its spin phase while
 * no thread here was driving (it rings the bell). Serving every announced
 * round itself would steal rounds from threads waiting on their own
 * handles, which drive them without a context switch; and it steps aside as
 * soon as such a thread wants the role. */
static void *engine_main(void *arg) {
    cring_engine_t *e = arg;
    int rung = 1;
    cring__comm_background_thread(); /* nobody waits on this thread's spin */
    while (!atomic_load(&e->stop)) {
        uint64_t token = cring__comm_wake_token(e->comm);
        if (rung) {
            /* Asynchronous submissions: give the producer CRING_CYCLE_TIME
             * to submit more, so they fuse; a thread that starts waiting
             * drives at once instead (it does not wait for this timer). */
            pthread_mutex_lock(&e->queue.mu);
            int queued = e->queue.head != NULL;
            pthread_mutex_unlock(&e->queue.mu);
            if (queued && e->drive.cycle_time_s > 0 && !atomic_load(&e->drive.callers_waiting)) {
                struct timespec ts = {
                    (time_t)e->drive.cycle_time_s,
                    (long)((e->drive.cycle_time_s - (double)(time_t)e->drive.cycle_time_s) * 1e9)};
                nanosleep(&ts, NULL);
            }
            if (!try_drive(e) &&
                e->drive.park_while_busy) { /* busy: a thread drives for its own handle */
                park_while_busy(e, token);
                continue;
            }
        }
        rung = 0;
        if (atomic_load(&e->stop) || atomic_load(&e->broken) != CRING_OK) break;
        pthread_mutex_lock(&e->queue.mu);
        int queued = e->queue.head != NULL;
        pthread_mutex_unlock(&e->queue.mu);
        if (queued && !atomic_load(&e->drive.callers_waiting)) {
            rung = 1;
            continue;
        }
        rung = cring__comm_idle_wait(e->comm, token, 0.5);
    }
    return NULL;
}

/* Wait for h as its driver until it is done or deadline_s (0: none) passes;
 * returns 1 once done. Taking progress_mu is itself bounded by the deadline,
 * so a wait with one never blocks past it behind another driver. */
static int wait_until(cring_handle_t *h, double deadline_s) {
    cring_engine_t *e = h->engine;
    while (!atomic_load(&h->done)) {
        atomic_fetch_add(&e->drive.callers_waiting, 1);
        if (deadline_s > 0 && pthread_mutex_trylock(&e->drive.mu) == 0) {
            /* free at once: the common case, no clock read */
        } else if (deadline_s > 0) {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            double left = deadline_s - cring__now_coarse_s();
            if (left <= 0) {
                atomic_fetch_sub(&e->drive.callers_waiting, 1);
                return atomic_load(&h->done);
            }
            long ns = ts.tv_nsec + (long)((left - (double)(time_t)left) * 1e9);
            ts.tv_sec += (time_t)left + ns / 1000000000L;
            ts.tv_nsec = ns % 1000000000L;
            if (pthread_mutex_timedlock(&e->drive.mu, &ts) != 0) {
                atomic_fetch_sub(&e->drive.callers_waiting, 1);
                return atomic_load(&h->done);
            }
        } else {
            pthread_mutex_lock(&e->drive.mu);
        }
        atomic_fetch_sub(&e->drive.callers_waiting, 1);
        drive_locked(e, h, deadline_s);
        int stopped = atomic_load(&e->stop);
        /* read as the driver: requests held for their bucket need rounds
         * (their release votes) after this thread leaves, so the engine
         * thread takes over (bucket.c: nothing is held forever) */
        int holding = e->bucket.plan.nheld > 0;
        pthread_mutex_unlock(&e->drive.mu);
        if (holding || atomic_load(&e->drive.thread_parked)) cring__comm_wake(e->comm);
        if (stopped && !atomic_load(&h->done)) wait_done_cv(e, h, 10 * 1000 * 1000);
        if (atomic_load(&h->done)) return 1;
        if (deadline_s > 0 && cring__now_coarse_s() >= deadline_s) return atomic_load(&h->done);
    }
    return 1;
}

cring_status_t cring_handle_wait(cring_handle_t *h) {
    wait_until(h, 0);
    return h->status;
}

int cring_handle_wait_for(cring_handle_t *h, double timeout_s) {
    if (atomic_load(&h->done)) return 1;
    if (timeout_s <= 0) return 0;
    /* the coarse clock: these deadlines only bound how long a wait goes
     * without running signal handlers, and a precise clock read was a
     * measurable part of a small synchronous call */
    return wait_until(h, cring__now_coarse_s() + timeout_s);
}

/* ---- lifecycle ------------------------------------------------------------------- */

void cring__engine_release(cring_engine_t *e) {
    if (atomic_fetch_sub(&e->refs, 1) != 1) return;
    cring__spare_free_all(e);
    pthread_mutex_destroy(&e->queue.mu);
    pthread_mutex_destroy(&e->done.mu);
    pthread_cond_destroy(&e->done.cv);
    pthread_mutex_destroy(&e->drive.mu);
    pthread_mutex_destroy(&e->timeline_mu);
    free(e);
}

cring_status_t cring_engine_start(cring_comm_t *comm, cring_engine_t **out) {
    *out = NULL;
    cring_engine_t *e = calloc(1, sizeof *e);
    if (!e) {
        cring_comm_destroy(comm);
        return cring__engine_submit_fail(CRING_ERR_NO_MEMORY, "out of memory");
    }
    e->comm = comm;
    e->rank = cring_comm_rank(comm);
    e->size = cring_comm_size(comm);
    atomic_store(&e->refs, 1);
    pthread_mutex_init(&e->queue.mu, NULL);
    pthread_mutex_init(&e->done.mu, NULL);
    pthread_cond_init(&e->done.cv, NULL);
    pthread_mutex_init(&e->drive.mu, NULL);
    pthread_mutex_init(&e->timeline_mu, NULL);
    cring__pool_init(&e->spare.handles);
    cring__pool_init(&e->spare.reqs);
    cring__result_cache_configure(); /* CRING_RESULT_CACHE_BYTES, read again per job */
    long threshold = cring__env_long("CRING_FUSION_THRESHOLD", DEFAULT_FUSION_THRESHOLD);
    e->exec.threshold = threshold > 0 ? (size_t)threshold : 0;
    e->drive.cycle_time_s = cring__env_double("CRING_CYCLE_TIME", 1.0) / 1000.0;
    e->neg.stall_check_s = cring__env_double("CRING_STALL_CHECK_SECONDS", 60.0);
    e->neg.stall_shutdown_s = cring__env_double("CRING_STALL_SHUTDOWN_SECONDS", 0.0);
    e->cache.capacity = (int)cring__env_long("CRING_CACHE_CAPACITY", DEFAULT_CACHE_CAPACITY);
    if (e->cache.capacity < 0) e->cache.capacity = 0;
    cring__autotune_start(e); /* after the knobs it tunes */
    e->join.vhdr = CRING__V_HEADER + (size_t)e->size;
    e->drive.park_while_busy = cring__comm_idle_wait_sees_peer_input(comm);
    e->neg.timeout_s = cring__comm_timeout_s(comm);
    e->backends[CRING_DEVICE_CPU] = &cring__backend_cpu;
    e->backends[CRING_DEVICE_CUDA] = &cring__backend_cuda;
    e->join.joined = calloc((size_t)e->size, 1);
    e->join.round = calloc((size_t)e->size, sizeof *e->join.round);
    e->cache.slots =
        calloc((size_t)(e->cache.capacity ? e->cache.capacity : 1), sizeof *e->cache.slots);
    e->cache.slot_state = malloc((size_t)(e->cache.capacity ? e->cache.capacity : 1));
    if (e->cache.slot_state)
        memset(e->cache.slot_state, 1, (size_t)(e->cache.capacity ? e->cache.capacity : 1));
    if (!e->cache.slots || !e->cache.slot_state || !e->join.joined || !e->join.round) {
        free(e->cache.slot_state);
        free(e->join.joined);
        free(e->join.round);
        cring_comm_destroy(comm);
        cring__engine_release(e);
        return cring__engine_submit_fail(CRING_ERR_NO_MEMORY, "out of memory");
    }
    const char *tl = getenv("CRING_TIMELINE");
    const char *all_ranks = getenv("CRING_TIMELINE_ALL_RANKS");
    int per_rank = all_ranks && *all_ranks && strcmp(all_ranks, "0") != 0;
    if (tl && *tl && (per_rank || e->rank == 0)) {
        char path[8192];
        /* Horovod's layout: rank 0 writes the path itself. With
         * CRING_TIMELINE_ALL_RANKS every rank writes one: "trace.json" ->
         * "trace.json" on rank 0 of 1, "trace.<rank>.json" otherwise. */
        const char *dot = strrchr(tl, '.');
        if (!per_rank) snprintf(path, sizeof path, "%s", tl);
        else if (e->size > 1 && dot && !strchr(dot, '/'))
            snprintf(path, sizeof path, "%.*s.%d%s", (int)(dot - tl), tl, e->rank, dot);
        else if (e->size > 1) snprintf(path, sizeof path, "%s.%d", tl, e->rank);
        else snprintf(path, sizeof path, "%s", tl);
        if (cring__timeline_open(path, e->rank, &e->timeline) != CRING_OK)
            cring__log(CRING__LOG_WARNING, e->rank, "CRING_TIMELINE: cannot write %s", path);
        atomic_store(&e->timeline_on, e->timeline != NULL);
        const char *mark = getenv("CRING_TIMELINE_MARK_CYCLES");
        atomic_store(&e->timeline_mark_cycles, mark && *mark && strcmp(mark, "0") != 0);
    }
    if (pthread_create(&e->thread, NULL, engine_main, e) != 0) {
        cring_comm_destroy(comm);
        cring__timeline_close(e->timeline);
        free(e->cache.slots);
        free(e->cache.slot_state);
        free(e->join.joined);
        free(e->join.round);
        cring__engine_release(e);
        return cring__engine_submit_fail(CRING_ERR_SYSTEM, "cannot start the engine thread");
    }
    e->thread_started = 1;
    *out = e;
    return CRING_OK;
}

cring_comm_t *cring_engine_comm(cring_engine_t *e) { return e->comm; }

void cring_engine_stop(cring_engine_t *e) {
    if (!e) return;
    pthread_mutex_lock(&e->queue.mu);
    atomic_store(&e->stop, 1);
    pthread_mutex_unlock(&e->queue.mu);
    cring__comm_wake(e->comm);
    if (e->thread_started) pthread_join(e->thread, NULL);
    pthread_mutex_lock(&e->drive.mu);
    cring__negotiate_fail_all(e, CRING_ERR_CLOSED,
                              "cring was shut down before this request completed");
    for (int t = 0; t < CRING__DEVICE_TYPES; t++)
        if (e->backends[t] && e->backends[t]->shutdown) e->backends[t]->shutdown(e);
    cring__table_free_all(e);
    cring__negotiate_free(e);
    free(e->join.joined);
    free(e->join.round);
    e->join.joined = NULL;
    e->join.round = NULL;
    free(e->exec.fusion);
    e->exec.fusion = NULL;
    free(e->exec.batch);
    e->exec.batch = NULL;
    e->exec.batch_cap = 0;
    cring__autotune_stop(e);
    cring_comm_destroy(e->comm);
    e->comm = NULL;
    pthread_mutex_unlock(&e->drive.mu);
    pthread_mutex_lock(&e->timeline_mu);
    cring__timeline_close(e->timeline);
    e->timeline = NULL;
    pthread_mutex_unlock(&e->timeline_mu);
    pthread_mutex_lock(&e->queue.mu);
    cring__strmap_free(&e->queue.in_flight);
    pthread_mutex_unlock(&e->queue.mu);
    cring__engine_release(e);
}

cring_status_t cring_engine_exclusive(cring_engine_t *e,
                                      cring_status_t (*fn)(cring_comm_t *, void *), void *arg) {
    pthread_mutex_lock(&e->drive.mu);
    cring_status_t st = e->comm ? fn(e->comm, arg) : CRING_ERR_CLOSED;
    pthread_mutex_unlock(&e->drive.mu);
    return st;
}

void cring_engine_get_stats(cring_engine_t *e, cring_engine_stats_t *out) {
    out->cycles = atomic_load(&e->stats.cycles);
    out->collectives = atomic_load(&e->stats.collectives);
    out->tensors = atomic_load(&e->stats.tensors);
    out->fused_tensors = atomic_load(&e->stats.fused_tensors);
    out->cache_hits = atomic_load(&e->stats.cache_hits);
    out->errors = atomic_load(&e->stats.errors);
    out->bucket_held = atomic_load(&e->stats.bucket_held);
    out->bucket_idle_releases = atomic_load(&e->stats.bucket_idle_releases);
    cring__comm_traffic_t traffic;
    cring__comm_traffic(e->comm, &traffic);
    out->tcp_bytes_sent = traffic.tcp_bytes_sent;
    out->tcp_bytes_received = traffic.tcp_bytes_received;
    out->shm_bytes_sent = traffic.shm_bytes_sent;
    out->shm_bytes_received = traffic.shm_bytes_received;
    out->fusion_threshold_bytes = atomic_load(&e->tune.shown_threshold_bytes);
    out->cycle_time_ms = atomic_load(&e->tune.shown_cycle_time_us) / 1000.0;
    out->autotune = atomic_load(&e->tune.shown_state);
}

void cring_engine_timeline_mark_cycles(cring_engine_t *e, int on) {
    atomic_store(&e->timeline_mark_cycles, on != 0);
}

cring_status_t cring_engine_timeline(cring_engine_t *e, const char *path) {
    cring__timeline_t *tl = NULL;
    if (path) CRING_CHECK(cring__timeline_open(path, e->rank, &tl));
    pthread_mutex_lock(&e->timeline_mu);
    cring__timeline_t *old = e->timeline;
    e->timeline = tl;
    atomic_store(&e->timeline_on, tl != NULL);
    pthread_mutex_unlock(&e->timeline_mu);
    cring__timeline_close(old);
    return CRING_OK;
}
