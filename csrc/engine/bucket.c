/* bucket.c: gradient buckets for CUDA allreduces, the engine's side. Hands
 * the round's ready requests of the planned kind to the planner
 * (bucket_plan.c: the plan, what is held, the release rules), turns what it
 * releases back into the round's responses, and gives it the clock and what
 * this rank's waiting thread needs, for the release vote (V[3], V[4] of the
 * negotiation vector). Moves no data and never touches CPU requests.
 *
 * Why: a backward pass submits its gradients one by one over tens of ms, and
 * each negotiation round ran what had arrived by then, so a ResNet-50 step
 * reached NCCL as a call per round (31-37), where DDP's reducer makes one per
 * 25 MB bucket (about 4).
 *
 * Which requests take part: named CUDA allreduces of one dtype, without
 * compression. An unnamed call (CRING_REQUEST_SEQUENCED: its generated name
 * comes round again every few dozen calls, for the response cache) is no
 * gradient and never waits for company. Every rank holds and releases the
 * same requests at the same point: the ready order, the sizes and keys, the
 * threshold, the flag and the release flags are agreed. Nothing is held
 * forever: the planner votes to release everything once no gradient of the
 * plan became ready, went or ran for CRING__HOLD_IDLE_S (0.2 s; no other
 * work counts), and at the latest CRING__HOLD_MAX_S (2 s) after a request
 * was held, whatever else runs; a thread waiting while a bucket misses a
 * name this rank has not submitted votes at once. Rounds go on while
 * something is held (a driving thread that leaves then wakes the engine
 * thread: engine.c). While some rank has joined, nothing is held and the
 * plan starts over. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine_internal.h"

/* ---- which requests take part ------------------------------------------------------- */

static int planned_kind(const req_t *r) {
    if (r->device.type != CRING_DEVICE_CUDA || r->coll != CRING_COLL_ALLREDUCE ||
        r->compression != CRING_DTYPE_COUNT || !r->handle || r->sequenced)
        return 0;
    for (int i = 1; i < r->ntensors; i++)
        if (r->t[i].dtype != r->t[0].dtype) return 0;
    return r->ntensors > 0;
}

static int candidate(const response_t *x) {
    return x->status == CRING_OK && !x->executed && planned_kind(x->req);
}

static cring__bplan_req_t plan_req(req_t *r) {
    size_t bytes = 0;
    for (int i = 0; i < r->ntensors; i++) bytes += r->t[i].bytes;
    return (cring__bplan_req_t){.name = r->name,
                                .name_hash = r->name_hash,
                                .key = {.device_type = (int)r->device.type,
                                        .dtype = r->t[0].dtype,
                                        .op = r->op,
                                        .prescale = r->prescale,
                                        .postscale = r->postscale},
                                .bytes = bytes,
                                .token = r};
}

/* ---- releasing --------------------------------------------------------------------------- */

/* Released requests of this round, appended to the round's responses. */
typedef struct {
    cring_engine_t *e;
    req_t **reqs;
    int n, cap;
} released_t;

/* The sink of a round: a released request joins the round's responses. */
static void take_released(void *ctx, void *token, const cring__bplan_release_t *info) {
    released_t *out = ctx;
    cring_engine_t *e = out->e;
    req_t *r = token;
    if (e->timeline) {
        char args[160];
        snprintf(args, sizeof args,
                 "\"bucket\": %d, \"plan\": %llu, \"bucket_tensors\": %d, \"bucket_bytes\": %zu, "
                 "\"release\": \"%s\"",
                 info->bucket, (unsigned long long)info->plan, info->bucket_tensors,
                 info->bucket_bytes, info->why);
        cring__engine_span(e, r->name, "WAIT_FOR_BUCKET", r->ready_s, cring__engine_tl_now(e),
                           args);
    }
    if (out->n == out->cap) {
        int cap = out->cap ? 2 * out->cap : 64;
        req_t **q = realloc(out->reqs, (size_t)cap * sizeof *q);
        if (!q) {
            cring__engine_complete(e, r, CRING_ERR_NO_MEMORY, "out of memory");
            cring__req_free(r);
            return;
        }
        out->reqs = q;
        out->cap = cap;
    }
    out->reqs[out->n++] = r;
}

void cring__bucket_round(cring_engine_t *e, response_list_t *l, int release_all, int cut) {
    cring__bplan_t *p = &e->bucket.plan;
    released_t out = {.e = e};
    const cring__bplan_sink_t sink = {take_released, &out};
    const double now = cring__now_coarse_s();
    int kept = 0;
    if (e->join.njoined > 0) { /* joined ranks' stand-ins: no holding, start over */
        cring__bplan_release_all(p, "join", &sink);
        cring__bplan_forget(p);
        kept = l->n;
        goto append;
    }
    for (int i = 0; i < l->n; i++) {
        response_t x = l->items[i];
        if (!candidate(&x)) {
            l->items[kept++] = x;
            continue;
        }
        const cring__bplan_req_t pr = plan_req(x.req);
        const int taken = cring__bplan_ready(p, &pr, e->exec.threshold, release_all, now, &sink);
        if (!taken) {
            l->items[kept++] = x;
            continue;
        }
        free(x.owned_dims); /* only an allgather reads it */
        free(x.error);
        if (taken == CRING__BPLAN_HELD) cring__engine_stats_add(&e->stats.bucket_held, 1);
    }
    if (release_all && cut && p->nheld > 0)
        cring__engine_stats_add(&e->stats.bucket_idle_releases, 1);
    cring__bplan_round_end(p, release_all, cut, now, &sink);
append:
    l->n = kept;
    for (int i = 0; i < out.n; i++) {
        response_t *x = cring__response_add(l);
        if (!x) {
            cring__engine_complete(e, out.reqs[i], CRING_ERR_NO_MEMORY, "out of memory");
            cring__req_free(out.reqs[i]);
            continue;
        }
        x->req = out.reqs[i];
    }
    free(out.reqs);
}

void cring__bucket_ran(cring_engine_t *e) {
    cring__bplan_executed(&e->bucket.plan, cring__now_coarse_s());
}

/* ---- the vote --------------------------------------------------------------------------- */

static int submitted_here(const void *ctx, const char *name) {
    const cring_engine_t *e = ctx;
    return cring__strmap_get(&e->neg.pending, name) != NULL;
}

int cring__bucket_release_wanted(cring_engine_t *e) {
    const cring__bplan_t *p = &e->bucket.plan;
    if (p->nentries == 0) return 0;
    cring_handle_t *h = e->drive.until;
    cring__bplan_waiter_t w = {.submitted = submitted_here, .ctx = e};
    const int waits = h && !atomic_load(&h->done);
    if (waits) {
        const req_t *r = h->req;
        if (r && planned_kind(r)) {
            w.name = r->name;
            w.name_hash = r->name_hash;
        }
    }
    return cring__bplan_vote(p, cring__now_coarse_s(), waits ? &w : NULL);
}

/* ---- failing and freeing ---------------------------------------------------------------- */

typedef struct {
    cring_engine_t *e;
    cring_status_t st;
    const char *msg;
} failing_t;

static void fail_released(void *ctx, void *token, const cring__bplan_release_t *info) {
    (void)info;
    failing_t *f = ctx;
    cring__engine_complete(f->e, token, f->st, f->msg);
    cring__req_free(token);
}

void cring__bucket_fail_all(cring_engine_t *e, cring_status_t st, const char *msg) {
    failing_t f = {e, st, msg};
    const cring__bplan_sink_t sink = {fail_released, &f};
    cring__bplan_release_all(&e->bucket.plan, "fail", &sink);
    cring__bplan_refill(&e->bucket.plan);
}

void cring__bucket_free(cring_engine_t *e) { cring__bplan_free(&e->bucket.plan); }
