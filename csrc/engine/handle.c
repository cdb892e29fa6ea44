/* handle.c: handles and what they own: completing a request's handle (status,
 * message, waking waiters), the handle accessors of the public API, and the
 * result memory (large results from the process-wide result cache). Never drives rounds or waits: a
 * freed handle only drops the caller's reference (the engine keeps its own
 * until the request completes or the engine stops). */
#include <sched.h>
#include <stdlib.h>
#include <string.h>

#include "../common/result_cache.h"
#include "engine_internal.h"

/* At most this many freed handles or requests are kept (a few hundred KiB) */
#define POOL_MAX 4096

void cring__pool_init(cring__pool_t *p) {
    atomic_flag_clear(&p->busy);
    p->head = NULL;
    atomic_store(&p->count, 0);
}

static void pool_lock(cring__pool_t *p) {
    for (int spins = 0; atomic_flag_test_and_set_explicit(&p->busy, memory_order_acquire);)
        if (++spins % 64 == 0) sched_yield(); /* the holder was preempted */
}

static void pool_unlock(cring__pool_t *p) {
    atomic_flag_clear_explicit(&p->busy, memory_order_release);
}

void *cring__pool_take(cring__pool_t *p) {
    if (atomic_load_explicit(&p->count, memory_order_relaxed) == 0) return NULL;
    pool_lock(p);
    void *block = p->head;
    if (block) {
        memcpy(&p->head, block, sizeof p->head);
        atomic_store_explicit(&p->count, atomic_load_explicit(&p->count, memory_order_relaxed) - 1,
                              memory_order_relaxed);
    }
    pool_unlock(p);
    return block;
}

int cring__pool_give(cring__pool_t *p, void *block) {
    if (atomic_load_explicit(&p->count, memory_order_relaxed) >= POOL_MAX) return 0;
    pool_lock(p);
    memcpy(block, &p->head, sizeof p->head);
    p->head = block;
    atomic_store_explicit(&p->count, atomic_load_explicit(&p->count, memory_order_relaxed) + 1,
                          memory_order_relaxed);
    pool_unlock(p);
    return 1;
}

void cring__pool_free_all(cring__pool_t *p) {
    while (p->head) {
        void *block = p->head;
        memcpy(&p->head, block, sizeof p->head);
        free(block);
    }
    atomic_store(&p->count, 0);
}

static void output_free(cring_engine_t *e, void *p, size_t bytes);

void cring__handle_release(cring_handle_t *h) {
    if (atomic_fetch_sub(&h->refs, 1) != 1) return;
    cring_engine_t *e = h->engine;
    for (int i = 0; h->outputs && i < h->ntensors; i++) {
        size_t bytes = h->output_bytes ? h->output_bytes[i] : 0;
        if (h->output_lent && h->output_lent[i]) continue; /* the caller's */
        if (h->free_output) {
            if (h->outputs[i]) h->free_output(h->free_ctx, h->outputs[i], bytes);
        } else {
            output_free(e, h->outputs[i], bytes);
        }
    }
    if (h->device_event) h->device_event_put(h->device_event);
    /* output_bytes, output_lent and first_dims live in the same block
     * (cring__handle_outputs), or all four in the handle itself */
    if (h->outputs != &h->one.output) free(h->outputs);
    free(h->error);
    /* keep one for the next submission: a synchronous loop then allocates
     * no handle (the engine frees the spare when it goes) */
    if (e) {
        cring_handle_t *old = atomic_exchange(&e->spare.handle, h);
        if (old && !cring__pool_give(&e->spare.handles, old)) free(old);
    } else {
        free(h);
    }
    if (e) cring__engine_release(e);
}

/* Complete a request: record the status, drop the name from the in-flight set,
 * wake waiters, release the engine's reference. The caller owns r. */
void cring__engine_complete(cring_engine_t *e, req_t *r, cring_status_t st, const char *error) {
    cring_handle_t *h = r->handle;
    if (!h) return;    /* a joined rank's stand-in */
    if (e->timeline) { /* a user who saw the handle complete finds it in the file */
        if (st == CRING_OK) cring__engine_span_done(e, r);
        pthread_mutex_lock(&e->timeline_mu);
        cring__timeline_flush(e->timeline);
        pthread_mutex_unlock(&e->timeline_mu);
    }
    h->req = NULL;
    h->status = st;
    if (st != CRING_OK) h->error = strdup(error && *error ? error : cring_status_string(st));
    cring__engine_name_done(e, r, st, error);
    cring__engine_stats_add(&e->stats.tensors, (uint64_t)r->ntensors);
    if (st != CRING_OK) cring__engine_stats_add(&e->stats.errors, 1);
    atomic_store(&h->done, 1);
    if (atomic_load(&e->done.waiters)) { /* seq_cst: pairs with wait_done_cv */
        pthread_mutex_lock(&e->done.mu);
        pthread_cond_broadcast(&e->done.cv);
        pthread_mutex_unlock(&e->done.mu);
    }
    cring__handle_release(h);
}

int cring_handle_done(const cring_handle_t *h) { return atomic_load(&((cring_handle_t *)h)->done); }
cring_status_t cring_handle_status(const cring_handle_t *h) { return h->status; }
const char *cring_handle_error(const cring_handle_t *h) { return h->error ? h->error : ""; }
int64_t cring_handle_value(const cring_handle_t *h) { return h->value; }
void *cring_handle_device_event(const cring_handle_t *h) {
    return atomic_load(&((cring_handle_t *)h)->done) ? h->device_event : NULL;
}

const void *cring_handle_output(const cring_handle_t *h, int index, size_t *bytes_out,
                                const int64_t **first_dims_out) {
    if (!h->outputs || index < 0 || index >= h->ntensors) return NULL;
    if (bytes_out) *bytes_out = h->output_bytes[index];
    if (first_dims_out) *first_dims_out = h->first_dims + (size_t)index * (size_t)h->size;
    return h->outputs[index];
}

void *cring_handle_take_output(cring_handle_t *h, int index, size_t *bytes_out,
                               cring_output_free_fn *free_out, void **ctx_out) {
    if (!atomic_load(&h->done) || !h->outputs || !h->free_output || index < 0 ||
        index >= h->ntensors || !h->outputs[index] || (h->output_lent && h->output_lent[index]))
        return NULL;
    void *p = h->outputs[index];
    h->outputs[index] = NULL; /* the handle's release no longer frees it */
    *bytes_out = h->output_bytes[index];
    *free_out = h->free_output;
    *ctx_out = h->free_ctx;
    return p;
}

void cring_handle_free(cring_handle_t *h) {
    if (h) cring__handle_release(h);
}

cring_status_t cring__handle_outputs(cring_handle_t *h, int ntensors, int size) {
    const size_t n = (size_t)ntensors, dims = n * (size_t)size;
    if (n == 1 && dims <= sizeof h->one.first_dims / sizeof h->one.first_dims[0]) {
        memset(&h->one, 0, sizeof h->one);
        h->outputs = &h->one.output;
        h->output_bytes = &h->one.bytes;
        h->first_dims = h->one.first_dims;
        h->output_lent = &h->one.lent;
        return CRING_OK;
    }
    /* pointers and sizes first, then the int64 dims (8-aligned), the flags last */
    char *block = calloc(1, n * (sizeof(void *) + sizeof(size_t)) + dims * sizeof(int64_t) + n);
    if (!block) return CRING_ERR_NO_MEMORY;
    h->outputs = (void **)(void *)block;
    h->output_bytes = (size_t *)(void *)(block + n * sizeof(void *));
    h->first_dims = (int64_t *)(void *)(block + n * (sizeof(void *) + sizeof(size_t)));
    h->output_lent = (unsigned char *)(h->first_dims + dims);
    return CRING_OK;
}

/* ---- result memory ------------------------------------------------------------- */

/* A result of `bytes`: from 1 MiB a block of the process-wide result cache
 * (common/result_cache.c: a loop of large allgathers reuses freed results
 * instead of faulting in fresh pages), else malloc. NULL when out of memory. */
void *cring__output_alloc(cring_engine_t *e, size_t bytes) {
    (void)e;
    if (bytes < CRING_RESULT_CACHE_MIN_BYTES) return malloc(bytes ? bytes : 1);
    void *p;
    return cring__result_block_get(bytes, &p) == CRING_OK ? p : NULL;
}

void *cring__output_lend(cring_handle_t *h, int i, const tensor_spec_t *t, size_t room,
                         size_t bytes) {
    h->output_bytes[i] = bytes;
    if (!t->recv || bytes > room) return NULL;
    h->output_lent[i] = 1;
    return h->outputs[i] = t->recv;
}

void *cring__output_place(cring_engine_t *e, cring_handle_t *h, int i, const tensor_spec_t *t,
                          size_t room, size_t bytes) {
    void *lent = cring__output_lend(h, i, t, room, bytes);
    return lent ? lent : (h->outputs[i] = cring__output_alloc(e, bytes));
}

/* Free a result of cring__output_alloc(e, bytes). */
static void output_free(cring_engine_t *e, void *p, size_t bytes) {
    (void)e;
    if (bytes < CRING_RESULT_CACHE_MIN_BYTES) free(p);
    else cring__result_block_put(p, bytes);
}

/* The engine is going: free the kept memory (engine_release). */
void cring__spare_free_all(cring_engine_t *e) {
    free(atomic_load(&e->spare.handle));
    free(atomic_load(&e->spare.req));
    cring__pool_free_all(&e->spare.handles);
    cring__pool_free_all(&e->spare.reqs);
}
