/* bucket.c: gradient buckets for CUDA allreduces. Learns a bucket plan from
 * the order in which names became ready in the last step, holds a ready
 * tensor until the rest of its bucket is ready everywhere, then releases the
 * bucket to execute.c as one batch (one NCCL call). Decides only from what
 * every rank agreed on; moves no data and never touches CPU requests.
 *
 * Why: a backward pass submits its gradients one by one over tens of ms, and
 * each negotiation round ran what had arrived by then, so a ResNet-50 step
 * reached NCCL as a call per round (31-37), where DDP's reducer makes one per
 * 25 MB bucket (about 4).
 *
 *   step k:    g160 g159 ... g120 | g119 ... g61 | g60 ... g0    ready order
 *              (recorded: names, sizes, fusion keys)             (agreed)
 *   step k+1:  plan = that order cut into buckets of >= 25 MiB (at most the
 *              fusion threshold) per fusion key:  B0 = [g160..g120], B1, B2
 *              g160 ready -> held;  ...;  g120 ready -> B0 complete: B0's
 *              requests go to execute.c together (one fused NCCL call)
 *
 * A step ends where a recorded name comes again; the plan is rebuilt there,
 * from the step just ended, taking only names the step before also had (a
 * name seen once, such as an unnamed call's, never waits for company). A
 * bucket of one name is never held, so a lone allreduce_async_ + synchronize
 * does not wait.
 *
 * Every rank holds and releases the same requests at the same point: the
 * ready order, the sizes and keys (from the records), the threshold and the
 * flags below are agreed. Nothing is held forever: every rank releases
 * everything held when a release flag of the negotiation vector (byte 3 or
 * 4) is 0, which a rank votes for when (a) a thread of it waits on a handle
 * (it then submits nothing more) while a held bucket, or the waited-on
 * request's own, misses a name this rank has not submitted: without the
 * vote that would deadlock; or (b) nothing arrived, left or ran for
 * HOLD_IDLE_S (a bucket whose other names never come, polled rather than
 * waited on; and the backstop for any other case). A release of kind (b)
 * also cuts the plan there, so a bucket whose names come apart and are only
 * polled is learned as two and waits no more. Kind (a) needs no cut: once
 * the plan holds, a waiter votes in the very round its request becomes
 * ready (allreduce(a); synchronize; allreduce(b); synchronize holds
 * nothing). While some rank has joined, nothing is held and the plan starts
 * over. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine_internal.h"

/* A bucket closes once it holds BUCKET_BYTES (DDP's default bucket_cap_mb=25)
 * or a STEP_BUCKETS-th of the step's bytes, whichever is more, and never
 * holds more than the fusion threshold, since one bucket is meant to be one
 * NCCL call. So ResNet-50 (100 MB of float32 gradients) takes DDP's 4
 * buckets and ViT-B/16 (330 MB) 7 rather than 14: on a GPU each bucket is
 * its own launch (buckets complete in different rounds as the backward pass
 * runs), and past 8 a step's launches cost more than the earlier start of
 * smaller buckets gains. */
#define BUCKET_BYTES ((size_t)25 << 20)
#define STEP_BUCKETS 8
/* Held requests with nothing arriving or leaving this long: release them. */
#define HOLD_IDLE_S 0.2
/* A recording without a repeated name this long is no training step. */
#define MAX_RECORDED 65536
/* Fusion keys with a bucket open at once while a plan is cut. */
#define MAX_OPEN 16

/* ---- which requests take part ------------------------------------------------------- */

static int planned_kind(const req_t *r) {
    if (r->device.type != CRING_DEVICE_CUDA || r->coll != CRING_COLL_ALLREDUCE ||
        r->compression != CRING_DTYPE_COUNT || !r->handle)
        return 0;
    for (int i = 1; i < r->ntensors; i++)
        if (r->t[i].dtype != r->t[0].dtype) return 0;
    return r->ntensors > 0;
}

static int candidate(const response_t *x) {
    return x->status == CRING_OK && !x->executed && planned_kind(x->req);
}

static cring__bucket_key_t key_of(const req_t *r) {
    return (cring__bucket_key_t){.device_type = (int)r->device.type,
                                 .dtype = r->t[0].dtype,
                                 .op = r->op,
                                 .prescale = r->prescale,
                                 .postscale = r->postscale};
}

static int key_eq(const cring__bucket_key_t *a, const cring__bucket_key_t *b) {
    return a->device_type == b->device_type && a->dtype == b->dtype && a->op == b->op &&
           a->prescale == b->prescale && a->postscale == b->postscale;
}

static size_t req_bytes(const req_t *r) {
    size_t n = 0;
    for (int i = 0; i < r->ntensors; i++) n += r->t[i].bytes;
    return n;
}

static int grow(void **p, int *cap, int need, size_t elem) {
    if (need <= *cap) return 0;
    int cap2 = *cap ? *cap : 64;
    while (cap2 < need) cap2 *= 2;
    void *q = realloc(*p, (size_t)cap2 * elem);
    if (!q) return -1;
    *p = q;
    *cap = cap2;
    return 0;
}

static int entry_of(const cring_engine_t *e, const req_t *r) {
    void *v = cring__strmap_get_h(&e->bucket.index, r->name, r->name_hash);
    return v ? (int)(intptr_t)v - 1 : -1;
}

/* ---- the plan ------------------------------------------------------------------------ */

static void plan_clear(cring_engine_t *e) {
    for (int i = 0; i < e->bucket.nentries; i++) free(e->bucket.entries[i].name);
    e->bucket.nentries = e->bucket.nbuckets = 0;
    cring__strmap_free(&e->bucket.index);
}

static void rec_clear(cring_engine_t *e) {
    for (int i = 0; i < e->bucket.nrec; i++) free(e->bucket.rec[i].name);
    e->bucket.nrec = 0;
    e->bucket.cut = 0;
    cring__strmap_free(&e->bucket.rec_index);
}

/* Cut the recorded step into buckets; keep its names for the next plan's
 * filter. Out of memory leaves no plan (nothing is held then). */
static void plan_build(cring_engine_t *e) {
    plan_clear(e);
    e->bucket.plans++;
    const int first_plan = e->bucket.prev_names.count == 0;
    const size_t threshold = e->exec.threshold;
    size_t step_bytes = 0;
    for (int j = 0; j < e->bucket.nrec; j++)
        if (first_plan || cring__strmap_get(&e->bucket.prev_names, e->bucket.rec[j].name))
            step_bytes += e->bucket.rec[j].bytes;
    size_t cap =
        step_bytes / STEP_BUCKETS > BUCKET_BYTES ? step_bytes / STEP_BUCKETS : BUCKET_BYTES;
    if (cap > threshold) cap = threshold;
    struct {
        cring__bucket_key_t key;
        int bucket;
    } open[MAX_OPEN];
    int nopen = 0, ok = 1;
    for (int j = 0; j < e->bucket.nrec && ok; j++) {
        const cring__rec_entry_t *x = &e->bucket.rec[j];
        if (x->cut_before) nopen = 0;
        if (!first_plan && !cring__strmap_get(&e->bucket.prev_names, x->name)) continue;
        int o = 0;
        while (o < nopen && !key_eq(&open[o].key, &x->key)) o++;
        if (o < nopen && e->bucket.buckets[open[o].bucket].bytes + x->bytes > threshold) {
            open[o] = open[--nopen]; /* it would not fit one call: close it */
            o = nopen;
        }
        if (o == nopen) {
            if (grow((void **)&e->bucket.buckets, &e->bucket.cap_buckets, e->bucket.nbuckets + 1,
                     sizeof *e->bucket.buckets) != 0) {
                ok = 0;
                break;
            }
            if (nopen == MAX_OPEN) open[0] = open[--nopen]; /* close one */
            o = nopen++;
            open[o].key = x->key;
            open[o].bucket = e->bucket.nbuckets;
            e->bucket.buckets[e->bucket.nbuckets++] = (cring__plan_bucket_t){0};
        }
        cring__plan_bucket_t *b = &e->bucket.buckets[open[o].bucket];
        if (grow((void **)&e->bucket.entries, &e->bucket.cap_entries, e->bucket.nentries + 1,
                 sizeof *e->bucket.entries) != 0) {
            ok = 0;
            break;
        }
        cring__plan_entry_t *pe = &e->bucket.entries[e->bucket.nentries];
        *pe = (cring__plan_entry_t){.name = strdup(x->name), .bucket = open[o].bucket};
        if (!pe->name || cring__strmap_put(&e->bucket.index, x->name,
                                           (void *)(intptr_t)(e->bucket.nentries + 1)) != 0) {
            free(pe->name);
            ok = 0;
            break;
        }
        e->bucket.nentries++;
        b->n++;
        b->bytes += x->bytes;
        if (b->bytes >= cap) open[o] = open[--nopen];
    }
    /* members grouped by bucket, in plan order within each (a counting sort) */
    int *members =
        ok ? realloc(e->bucket.members, sizeof(int) * (size_t)(e->bucket.nentries + 1)) : NULL;
    if (!members) {
        plan_clear(e);
    } else {
        e->bucket.members = members;
        int at = 0;
        for (int b = 0; b < e->bucket.nbuckets; b++) {
            e->bucket.buckets[b].first = at;
            at += e->bucket.buckets[b].n;
            e->bucket.buckets[b].n = 0;
        }
        for (int i = 0; i < e->bucket.nentries; i++) {
            cring__plan_bucket_t *b = &e->bucket.buckets[e->bucket.entries[i].bucket];
            members[b->first + b->n++] = i;
        }
    }
    /* this step's names filter the next plan */
    cring__strmap_free(&e->bucket.prev_names);
    for (int j = 0; j < e->bucket.nrec; j++)
        if (cring__strmap_put(&e->bucket.prev_names, e->bucket.rec[j].name, (void *)1) != 0) break;
}

/* ---- holding and releasing ------------------------------------------------------------- */

/* Released requests of this round, appended to the round's responses. */
typedef struct {
    req_t **reqs;
    int n, cap;
} released_t;

static void note_released(cring_engine_t *e, released_t *out, req_t *r, int b, const char *why,
                          double now) {
    if (e->timeline) {
        const cring__plan_bucket_t *pb = &e->bucket.buckets[b];
        char args[160];
        snprintf(args, sizeof args,
                 "\"bucket\": %d, \"plan\": %llu, \"bucket_tensors\": %d, \"bucket_bytes\": %zu, "
                 "\"release\": \"%s\"",
                 b, (unsigned long long)e->bucket.plans, pb->n, pb->bytes, why);
        cring__engine_span(e, r->name, "WAIT_FOR_BUCKET", r->ready_s, now, args);
    }
    if (grow((void **)&out->reqs, &out->cap, out->n + 1, sizeof *out->reqs) != 0) {
        cring__engine_complete(e, r, CRING_ERR_NO_MEMORY, "out of memory");
        cring__req_free(r);
        return;
    }
    out->reqs[out->n++] = r;
}

static void held_remove(cring_engine_t *e, int id) {
    int k = 0;
    for (int i = 0; i < e->bucket.nheld; i++)
        if (e->bucket.held[i] != id) e->bucket.held[k++] = e->bucket.held[i];
    e->bucket.nheld = k;
}

/* Release bucket b's held requests in plan order. */
static void release_bucket(cring_engine_t *e, int b, released_t *out, const char *why, double now) {
    const cring__plan_bucket_t *pb = &e->bucket.buckets[b];
    for (int m = 0; m < pb->n; m++) {
        cring__plan_entry_t *pe = &e->bucket.entries[e->bucket.members[pb->first + m]];
        if (!pe->held) continue;
        req_t *r = pe->held;
        pe->held = NULL;
        held_remove(e, e->bucket.members[pb->first + m]);
        note_released(e, out, r, b, why, now);
    }
}

/* Bucket b starts filling anew. */
static void bucket_reset(cring_engine_t *e, int b) {
    cring__plan_bucket_t *pb = &e->bucket.buckets[b];
    for (int m = 0; m < pb->n; m++) e->bucket.entries[e->bucket.members[pb->first + m]].seen = 0;
    pb->nseen = 0;
}

static void release_all(cring_engine_t *e, released_t *out, const char *why, double now) {
    while (e->bucket.nheld > 0) {
        int b = e->bucket.entries[e->bucket.held[0]].bucket;
        release_bucket(e, b, out, why, now);
    }
}

/* Does r's name come again in this step's recording? Then a new step begins. */
static int step_ends(const cring_engine_t *e, const req_t *r) {
    return cring__strmap_get_h(&e->bucket.rec_index, r->name, r->name_hash) != NULL;
}

/* Record r's name in this step's ready order (out of memory: it goes
 * unrecorded, and so unplanned). */
static void record(cring_engine_t *e, const req_t *r) {
    if (e->bucket.nrec >= MAX_RECORDED)
        rec_clear(e); /* no name repeats: nothing to learn, and no unbounded growth */
    if (grow((void **)&e->bucket.rec, &e->bucket.cap_rec, e->bucket.nrec + 1,
             sizeof *e->bucket.rec) != 0)
        return;
    cring__rec_entry_t *x = &e->bucket.rec[e->bucket.nrec];
    *x = (cring__rec_entry_t){.name = strdup(r->name),
                              .key = key_of(r),
                              .bytes = req_bytes(r),
                              .cut_before = e->bucket.cut};
    if (!x->name) return;
    if (cring__strmap_put(&e->bucket.rec_index, r->name, (void *)1) != 0) {
        free(x->name);
        return;
    }
    e->bucket.nrec++;
    e->bucket.cut = 0;
}

void cring__bucket_round(cring_engine_t *e, response_list_t *l, int release_everything, int cut) {
    released_t out = {0};
    double now = cring__engine_tl_now(e);
    int changed = 0, kept = 0;
    if (e->join.njoined > 0) { /* joined ranks' stand-ins: no holding, start over */
        release_all(e, &out, "join", now);
        plan_clear(e);
        rec_clear(e);
        cring__strmap_free(&e->bucket.prev_names);
        kept = l->n;
        goto append;
    }
    for (int i = 0; i < l->n; i++) {
        response_t x = l->items[i];
        if (!candidate(&x)) {
            l->items[kept++] = x;
            continue;
        }
        changed = 1;
        if (step_ends(e, x.req)) {
            release_all(e, &out, "step", now); /* the last step's leftovers, by the old plan */
            plan_build(e);
            rec_clear(e);
        }
        record(e, x.req);
        int id = entry_of(e, x.req);
        int b = id >= 0 ? e->bucket.entries[id].bucket : -1;
        if (b < 0 || e->bucket.buckets[b].n == 1) {
            l->items[kept++] = x;
            continue;
        }
        cring__plan_entry_t *pe = &e->bucket.entries[id];
        cring__plan_bucket_t *pb = &e->bucket.buckets[b];
        if (pe->seen) { /* its bucket filled only partly last time: start it anew */
            release_bucket(e, b, &out, "step", now);
            bucket_reset(e, b);
        }
        pe->seen = 1;
        pb->nseen++;
        if (release_everything) { /* runs now, but counts for its bucket */
            if (pb->nseen == pb->n) bucket_reset(e, b);
            l->items[kept++] = x;
            continue;
        }
        if (grow((void **)&e->bucket.held, &e->bucket.cap_held, e->bucket.nheld + 1,
                 sizeof *e->bucket.held) != 0) {
            l->items[kept++] = x; /* cannot hold it: it runs now */
            continue;
        }
        free(x.owned_dims); /* only an allgather reads it */
        free(x.error);
        pe->held = x.req;
        e->bucket.held[e->bucket.nheld++] = id;
        if (pb->nseen == pb->n) {
            release_bucket(e, b, &out, "complete", now);
            bucket_reset(e, b);
        }
    }
    if (release_everything && (e->bucket.nheld > 0 || changed)) {
        release_all(e, &out, cut ? "idle" : "wanted", now);
        if (cut) e->bucket.cut = 1; /* learn it: the next name starts a new bucket */
    }
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
    if (changed || out.n) e->bucket.last_change_s = cring__now_coarse_s();
    free(out.reqs);
}

/* Does bucket b miss a name (other than entry skip) that this rank has not
 * submitted? */
static int misses_local(cring_engine_t *e, int b, int skip) {
    const cring__plan_bucket_t *pb = &e->bucket.buckets[b];
    for (int m = 0; m < pb->n; m++) {
        int k = e->bucket.members[pb->first + m];
        const cring__plan_entry_t *pe = &e->bucket.entries[k];
        if (k == skip || pe->seen) continue;
        if (!cring__strmap_get(&e->neg.pending, pe->name)) return 1;
    }
    return 0;
}

void cring__bucket_ran(cring_engine_t *e) {
    if (e->bucket.nheld > 0) e->bucket.last_change_s = cring__now_coarse_s();
}

int cring__bucket_release_wanted(cring_engine_t *e) {
    if (e->bucket.nentries == 0) return 0;
    if (e->bucket.nheld > 0 && cring__now_coarse_s() - e->bucket.last_change_s > HOLD_IDLE_S)
        return CRING__RELEASE_IDLE;
    cring_handle_t *h = e->drive.until;
    if (!h || atomic_load(&h->done)) return 0; /* nobody here waits */
    /* A thread here waits, so this rank submits nothing more for now: a
     * bucket missing a name this rank has not submitted would not fill. The
     * waited-on request's own bucket is asked about before it is ready, so
     * a lone call is never held at all. */
    const req_t *r = h->req;
    int id = r && planned_kind(r) ? entry_of(e, r) : -1;
    if (id >= 0 && e->bucket.buckets[e->bucket.entries[id].bucket].n > 1 &&
        misses_local(e, e->bucket.entries[id].bucket, id))
        return CRING__RELEASE_WAITER;
    unsigned stamp = ++e->bucket.stamp;
    for (int i = 0; i < e->bucket.nheld; i++) {
        int b = e->bucket.entries[e->bucket.held[i]].bucket;
        if (e->bucket.buckets[b].stamp == stamp) continue;
        e->bucket.buckets[b].stamp = stamp;
        if (misses_local(e, b, -1)) return CRING__RELEASE_WAITER;
    }
    return 0;
}

void cring__bucket_fail_all(cring_engine_t *e, cring_status_t st, const char *msg) {
    for (int i = 0; i < e->bucket.nheld; i++) {
        cring__plan_entry_t *pe = &e->bucket.entries[e->bucket.held[i]];
        req_t *r = pe->held;
        pe->held = NULL;
        if (!r) continue;
        cring__engine_complete(e, r, st, msg);
        cring__req_free(r);
    }
    e->bucket.nheld = 0;
    for (int b = 0; b < e->bucket.nbuckets; b++) bucket_reset(e, b);
}

void cring__bucket_free(cring_engine_t *e) {
    plan_clear(e);
    rec_clear(e);
    cring__strmap_free(&e->bucket.prev_names);
    free(e->bucket.entries);
    free(e->bucket.buckets);
    free(e->bucket.members);
    free(e->bucket.rec);
    free(e->bucket.held);
    memset(&e->bucket, 0, sizeof e->bucket);
}
