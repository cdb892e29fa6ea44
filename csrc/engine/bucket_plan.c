/* bucket_plan.c: the gradient bucket planner (bucket_plan.h). Learns a plan
 * from the order in which names became ready in the last step, decides
 * which ready request waits for the rest of its bucket and when held ones
 * go, and this rank's vote for releasing everything. Plain functions of what
 * the caller passes (the time too): no engine, transport, clock or lock.
 *
 *   step k:    g160 g159 ... g120 | g119 ... g61 | g60 ... g0    ready order
 *              (recorded: names, sizes, fusion keys)             (agreed)
 *   step k+1:  plan = that order cut into buckets of >= 25 MiB (at most the
 *              fusion threshold) per fusion key:  B0 = [g160..g120], B1, B2
 *              g160 ready -> held;  ...;  g120 ready -> B0 complete: B0's
 *              requests go together (one fused NCCL call)
 *
 * A step ends where a recorded name comes again; the plan is rebuilt there,
 * from the step just ended, taking only names the step before also had (a
 * name seen once never waits for company). A bucket of one name is never
 * held. Held requests go when (1) their bucket is complete ("complete"),
 * (2) a new step begins, or a name of their bucket comes a second time in
 * one filling ("step"), or (3) the agreed release flag is set ("wanted",
 * "idle"), for which cring__bplan_vote gives this rank's vote. The idle vote
 * looks only at the plan's own names, so no other work (CPU collectives,
 * other CUDA names, unnamed calls) can keep a bucket held; and it comes at
 * the latest CRING__HOLD_MAX_S after a request was held, whatever else runs:
 * nothing is held longer than that plus a negotiation round. */
#include "bucket_plan.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* A recording without a repeated name this long is no training step. */
#define MAX_RECORDED 65536
/* Fusion keys with a bucket open at once while a plan is cut. */
#define MAX_OPEN 16

static int key_eq(const cring__bucket_key_t *a, const cring__bucket_key_t *b) {
    return a->device_type == b->device_type && a->dtype == b->dtype && a->op == b->op &&
           a->prescale == b->prescale && a->postscale == b->postscale;
}

/* Room for `need` elements of `elem` bytes in *p (capacity *cap); 0, or -1
 * when out of memory (*p unchanged). */
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

static int entry_of(const cring__bplan_t *p, const char *name, size_t hash) {
    void *v = cring__strmap_get_h(&p->index, name, hash);
    return v ? (int)(intptr_t)v - 1 : -1;
}

int cring__bplan_bucket_of(const cring__bplan_t *p, const char *name) {
    int id = entry_of(p, name, cring__strmap_hash(name));
    return id >= 0 ? p->entries[id].bucket : -1;
}

/* ---- the plan ------------------------------------------------------------------------ */

static void plan_clear(cring__bplan_t *p) {
    for (int i = 0; i < p->nentries; i++) free(p->entries[i].name);
    p->nentries = p->nbuckets = 0;
    cring__strmap_free(&p->index);
}

static void rec_clear(cring__bplan_t *p) {
    for (int i = 0; i < p->nrec; i++) free(p->rec[i].name);
    p->nrec = 0;
    p->cut = 0;
    cring__strmap_free(&p->rec_index);
}

/* Cut the recorded step into buckets (nothing is held); keep its names for
 * the next plan's filter. Out of memory leaves no plan (nothing is held). */
static void plan_build(cring__bplan_t *p, size_t threshold) {
    plan_clear(p);
    p->plans++;
    const int first_plan = p->prev_names.count == 0;
    size_t step_bytes = 0;
    for (int j = 0; j < p->nrec; j++)
        if (first_plan || cring__strmap_get(&p->prev_names, p->rec[j].name))
            step_bytes += p->rec[j].bytes;
    size_t cap = step_bytes / CRING__STEP_BUCKETS > CRING__BUCKET_BYTES
                     ? step_bytes / CRING__STEP_BUCKETS
                     : CRING__BUCKET_BYTES;
    if (cap > threshold) cap = threshold;
    struct {
        cring__bucket_key_t key;
        int bucket;
    } open[MAX_OPEN];
    int nopen = 0, ok = 1;
    for (int j = 0; j < p->nrec && ok; j++) {
        const cring__bplan_rec_t *x = &p->rec[j];
        if (x->cut_before) nopen = 0;
        if (!first_plan && !cring__strmap_get(&p->prev_names, x->name)) continue;
        int o = 0;
        while (o < nopen && !key_eq(&open[o].key, &x->key)) o++;
        if (o < nopen && p->buckets[open[o].bucket].bytes + x->bytes > threshold) {
            open[o] = open[--nopen]; /* it would not fit one call: close it */
            o = nopen;
        }
        if (o == nopen) {
            if (grow((void **)&p->buckets, &p->cap_buckets, p->nbuckets + 1, sizeof *p->buckets) !=
                0) {
                ok = 0;
                break;
            }
            if (nopen == MAX_OPEN) open[0] = open[--nopen]; /* close one */
            o = nopen++;
            open[o].key = x->key;
            open[o].bucket = p->nbuckets;
            p->buckets[p->nbuckets++] = (cring__bplan_bucket_t){0};
        }
        cring__bplan_bucket_t *b = &p->buckets[open[o].bucket];
        if (grow((void **)&p->entries, &p->cap_entries, p->nentries + 1, sizeof *p->entries) != 0) {
            ok = 0;
            break;
        }
        cring__bplan_entry_t *pe = &p->entries[p->nentries];
        *pe = (cring__bplan_entry_t){.name = strdup(x->name), .bucket = open[o].bucket};
        if (!pe->name ||
            cring__strmap_put(&p->index, x->name, (void *)(intptr_t)(p->nentries + 1)) != 0) {
            free(pe->name);
            ok = 0;
            break;
        }
        p->nentries++;
        b->n++;
        b->bytes += x->bytes;
        if (b->bytes >= cap) open[o] = open[--nopen];
    }
    /* members grouped by bucket, in plan order within each (a counting sort);
     * room to hold every entry, so holding never allocates */
    int *members = ok ? realloc(p->members, sizeof(int) * (size_t)(p->nentries + 1)) : NULL;
    if (members) p->members = members;
    int *held = members ? realloc(p->held, sizeof(int) * (size_t)(p->nentries + 1)) : NULL;
    if (held) p->held = held;
    if (!members || !held) {
        plan_clear(p);
    } else {
        int at = 0;
        for (int b = 0; b < p->nbuckets; b++) {
            p->buckets[b].first = at;
            at += p->buckets[b].n;
            p->buckets[b].n = 0;
        }
        for (int i = 0; i < p->nentries; i++) {
            cring__bplan_bucket_t *b = &p->buckets[p->entries[i].bucket];
            members[b->first + b->n++] = i;
        }
    }
    /* this step's names filter the next plan */
    cring__strmap_free(&p->prev_names);
    for (int j = 0; j < p->nrec; j++)
        if (cring__strmap_put(&p->prev_names, p->rec[j].name, (void *)1) != 0) break;
}

/* ---- holding and releasing ------------------------------------------------------------- */

/* Bucket b's held requests go through sink, in plan order. */
static void release_bucket(cring__bplan_t *p, int b, const char *why,
                           const cring__bplan_sink_t *sink) {
    cring__bplan_bucket_t *pb = &p->buckets[b];
    if (pb->nheld == 0) return;
    int k = 0; /* out of the held list, in one pass */
    for (int i = 0; i < p->nheld; i++)
        if (p->entries[p->held[i]].bucket != b) p->held[k++] = p->held[i];
    p->nheld = k;
    pb->nheld = 0;
    p->touched = 1;
    const cring__bplan_release_t info = {.why = why,
                                         .bucket = b,
                                         .bucket_tensors = pb->n,
                                         .bucket_bytes = pb->bytes,
                                         .plan = p->plans};
    for (int m = 0; m < pb->n; m++) {
        cring__bplan_entry_t *pe = &p->entries[p->members[pb->first + m]];
        if (!pe->held) continue;
        void *token = pe->held;
        pe->held = NULL;
        sink->release(sink->ctx, token, &info);
    }
}

/* Bucket b starts filling anew. */
static void bucket_reset(cring__bplan_t *p, int b) {
    cring__bplan_bucket_t *pb = &p->buckets[b];
    for (int m = 0; m < pb->n; m++) p->entries[p->members[pb->first + m]].seen = 0;
    pb->nseen = 0;
}

void cring__bplan_release_all(cring__bplan_t *p, const char *why, const cring__bplan_sink_t *sink) {
    while (p->nheld > 0) release_bucket(p, p->entries[p->held[0]].bucket, why, sink);
}

/* Record r's name in this step's ready order (out of memory: it goes
 * unrecorded, and so unplanned). */
static void record(cring__bplan_t *p, const cring__bplan_req_t *r) {
    if (p->nrec >= MAX_RECORDED)
        rec_clear(p); /* no name repeats: nothing to learn, and no unbounded growth */
    if (grow((void **)&p->rec, &p->cap_rec, p->nrec + 1, sizeof *p->rec) != 0) return;
    cring__bplan_rec_t *x = &p->rec[p->nrec];
    *x = (cring__bplan_rec_t){
        .name = strdup(r->name), .key = r->key, .bytes = r->bytes, .cut_before = p->cut};
    if (!x->name) return;
    if (cring__strmap_put(&p->rec_index, r->name, (void *)1) != 0) {
        free(x->name);
        return;
    }
    p->nrec++;
    p->cut = 0;
}

int cring__bplan_ready(cring__bplan_t *p, const cring__bplan_req_t *r, size_t threshold,
                       int release_all, double now_s, const cring__bplan_sink_t *sink) {
    p->round_ready = 1;
    if (cring__strmap_get_h(&p->rec_index, r->name, r->name_hash)) { /* a new step */
        cring__bplan_release_all(p, "step", sink); /* the last step's leftovers, by the old plan */
        plan_build(p, threshold);
        rec_clear(p);
    }
    record(p, r);
    int id = entry_of(p, r->name, r->name_hash);
    if (id < 0) return 0; /* not in the plan: no company to wait for, and no step's activity */
    p->last_plan_s = now_s;
    p->touched = 1;
    cring__bplan_entry_t *pe = &p->entries[id];
    const int b = pe->bucket;
    cring__bplan_bucket_t *pb = &p->buckets[b];
    if (pb->n == 1) return 0;
    if (pe->seen) { /* its bucket filled only partly last time: start it anew */
        release_bucket(p, b, "step", sink);
        bucket_reset(p, b);
    }
    pe->seen = 1;
    pb->nseen++;
    if (release_all) { /* runs now, but counts for its bucket */
        if (pb->nseen == pb->n) bucket_reset(p, b);
        return 0;
    }
    pe->held = r->token;
    pe->held_s = now_s;
    p->held[p->nheld++] = id; /* room for every entry: plan_build */
    pb->nheld++;
    if (pb->nseen == pb->n) {
        release_bucket(p, b, "complete", sink);
        bucket_reset(p, b);
        return CRING__BPLAN_COMPLETED;
    }
    return CRING__BPLAN_HELD;
}

void cring__bplan_round_end(cring__bplan_t *p, int release_all, int idle, double now_s,
                            const cring__bplan_sink_t *sink) {
    if (release_all && (p->nheld > 0 || p->round_ready)) {
        if (p->nheld > 0) p->last_plan_s = now_s;
        cring__bplan_release_all(p, idle ? "idle" : "wanted", sink);
        if (idle) p->cut = 1; /* learn it: the next name starts a new bucket */
    }
    p->round_ready = 0;
}

void cring__bplan_executed(cring__bplan_t *p, double now_s) {
    if (p->touched) p->last_plan_s = now_s;
    p->touched = 0;
}

/* ---- the vote -------------------------------------------------------------------------- */

/* Does bucket b miss a name (other than entry skip) that this rank has not
 * submitted? */
static int misses_local(const cring__bplan_t *p, int b, int skip, const cring__bplan_waiter_t *w) {
    const cring__bplan_bucket_t *pb = &p->buckets[b];
    for (int m = 0; m < pb->n; m++) {
        int k = p->members[pb->first + m];
        const cring__bplan_entry_t *pe = &p->entries[k];
        if (k == skip || pe->seen) continue;
        if (!w->submitted(w->ctx, pe->name)) return 1;
    }
    return 0;
}

int cring__bplan_vote(const cring__bplan_t *p, double now_s, const cring__bplan_waiter_t *w) {
    if (p->nentries == 0) return 0;
    if (p->nheld > 0 && (now_s - p->last_plan_s > CRING__HOLD_IDLE_S ||
                         now_s - p->entries[p->held[0]].held_s > CRING__HOLD_MAX_S))
        return CRING__RELEASE_IDLE;
    if (!w) return 0; /* nobody here waits */
    /* A thread here waits, so this rank submits nothing more for now: a
     * bucket missing a name this rank has not submitted would not fill. The
     * waited-on request's own bucket is asked about before it is ready, so
     * a lone call is never held at all. */
    int id = w->name ? entry_of(p, w->name, w->name_hash) : -1;
    if (id >= 0 && p->buckets[p->entries[id].bucket].n > 1 &&
        misses_local(p, p->entries[id].bucket, id, w))
        return CRING__RELEASE_WAITER;
    for (int b = 0; b < p->nbuckets; b++)
        if (p->buckets[b].nheld > 0 && misses_local(p, b, -1, w)) return CRING__RELEASE_WAITER;
    return 0;
}

/* ---- lifetime -------------------------------------------------------------------------- */

void cring__bplan_refill(cring__bplan_t *p) {
    for (int b = 0; b < p->nbuckets; b++) bucket_reset(p, b);
}

void cring__bplan_forget(cring__bplan_t *p) {
    plan_clear(p);
    rec_clear(p);
    cring__strmap_free(&p->prev_names);
    p->nheld = 0;
}

void cring__bplan_free(cring__bplan_t *p) {
    cring__bplan_forget(p);
    free(p->entries);
    free(p->buckets);
    free(p->members);
    free(p->rec);
    free(p->held);
    memset(p, 0, sizeof *p);
}
