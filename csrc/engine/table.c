/* table.c: the response cache (names every rank negotiated, each a slot in
 * the negotiation vector) and the table (names some ranks have described and
 * others not yet): draining the queue into them, exchanging records, answering
 * complete entries (agreement check, mismatch message) and timing out entries
 * that waited too long for missing ranks. Runs only on the driving thread;
 * never executes a collective on data. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../common/wire.h"
#include "engine_internal.h"

/* The collective byte of a record rank 0 sends instead of a request: "time
 * out this name" (no collective has value 0). */
#define RECORD_TIMEOUT_VERDICT 0

int cring__uncached_push(cring_engine_t *e, req_t *r) {
    if (e->neg.nuncached == e->neg.cap_uncached) {
        size_t cap = e->neg.cap_uncached ? 2 * e->neg.cap_uncached : 64;
        req_t **u = realloc(e->neg.uncached, cap * sizeof *u);
        if (!u) return -1;
        e->neg.uncached = u;
        e->neg.cap_uncached = cap;
    }
    e->neg.uncached[e->neg.nuncached++] = r;
    return 0;
}

static int cache_lookup(cring_engine_t *e, const req_t *r) {
    void *v = cring__strmap_get_h(&e->cache.index, r->name, r->name_hash);
    return v ? (int)(intptr_t)v - 1 : -1;
}

void cring__cache_evict(cring_engine_t *e, int id) {
    cache_slot_t *s = &e->cache.slots[id];
    if (!s->in_use) return;
    cring__strmap_remove(&e->cache.index, s->name);
    if (s->local) {
        s->local->cache_id = -1;
        cring__uncached_push(e, s->local);
    }
    free(s->name);
    free(s->record);
    free(s->first_dims);
    memset(s, 0, sizeof *s);
    e->cache.slot_state[id] = 1;
}

/* Insert a negotiated request: identical slot choice on every rank. */
static void cache_insert(cring_engine_t *e, req_t *r, const int64_t *first_dims) {
    int id = -1;
    for (int i = 0; i < e->cache.capacity; i++)
        if (!e->cache.slots[i].in_use) {
            id = i;
            break;
        }
    if (id < 0) return; /* full: the name keeps going through the table */
    cache_slot_t *s = &e->cache.slots[id];
    s->name = strdup(r->name);
    s->record = malloc(r->record_len);
    size_t ndims = (size_t)r->ntensors * (size_t)e->size;
    s->first_dims = malloc(sizeof(int64_t) * (ndims ? ndims : 1));
    if (!s->name || !s->record || !s->first_dims) {
        free(s->name);
        free(s->record);
        free(s->first_dims);
        memset(s, 0, sizeof *s);
        return;
    }
    memcpy(s->record, r->record, r->record_len);
    s->record_len = r->record_len;
    if (first_dims) memcpy(s->first_dims, first_dims, sizeof(int64_t) * ndims);
    s->in_use = 1;
    e->cache.slot_state[id] = 1;
    cring__strmap_put(&e->cache.index, r->name, (void *)(intptr_t)(id + 1));
    if (id + 1 > e->cache.nslots) e->cache.nslots = id + 1;
}

void cring__table_entry_free(table_entry_t *t, int size) {
    if (!t) return;
    for (int r = 0; r < size; r++) free(t->records[r]);
    free(t->records);
    free(t->lens);
    free(t->name);
    free(t);
}

/* Move queued requests into the driver's structures. */
void cring__engine_drain(cring_engine_t *e) {
    pthread_mutex_lock(&e->queue.mu);
    req_t *r = e->queue.head;
    e->queue.head = e->queue.tail = NULL;
    pthread_mutex_unlock(&e->queue.mu);
    while (r) {
        req_t *next = r->next;
        r->next = NULL;
        if (r->coll == CRING_COLL_JOIN) { /* takes effect once nothing else is pending */
            e->join.req = r;
            r = next;
            continue;
        }
        cring__strmap_put_borrowed_h(&e->neg.pending, r->name, r->name_hash, r);
        int id = cache_lookup(e, r);
        if (id >= 0 && e->cache.slots[id].record_len == r->record_len &&
            memcmp(e->cache.slots[id].record, r->record, r->record_len) == 0) {
            r->cache_id = id;
            e->cache.slots[id].local = r;
            e->neg.last_attached = r;
            if (e->cache.slot_state[id] != 0) e->cache.slot_state[id] = 2;
            cring__engine_stats_add(&e->stats.cache_hits, 1);
        } else {
            if (id >= 0) e->cache.slot_state[id] = 0; /* changed: everyone re-negotiates */
            cring__uncached_push(e, r);
        }
        r = next;
    }
}

response_t *cring__response_add(response_list_t *l) {
    if (l->n == l->cap) {
        int cap = l->cap ? 2 * l->cap : 64;
        response_t *nr = realloc(l->items, sizeof *nr * (size_t)cap);
        if (!nr) return NULL;
        l->items = nr;
        l->cap = cap;
    }
    response_t *out = &l->items[l->n++];
    memset(out, 0, sizeof *out);
    return out;
}

/* Fail this rank's request for t, if it has one, with status and msg. */
static cring_status_t fail_local(cring_engine_t *e, table_entry_t *t, response_list_t *l,
                                 cring_status_t status, const char *msg) {
    req_t *local = cring__strmap_get(&e->neg.pending, t->name);
    if (!local) return CRING_OK; /* a joined rank, or one that never submitted: nothing to fail */
    response_t *out = cring__response_add(l);
    if (!out) return CRING_ERR_NO_MEMORY;
    out->req = local;
    out->status = status;
    out->error = strdup(msg);
    return CRING_OK;
}

/* Do the descriptions disagree (or conflict with a join)? Then write the
 * message to msg and return the verdict. ref: the first rank that described. */
static cring_status_t check_agreement(cring_engine_t *e, const table_entry_t *t, int ref,
                                      const parsed_t *p0, char *msg, size_t n) {
    char why[512] = "", scratch[512], others[256] = "";
    int bad = -1, nbad = 0;
    size_t oo = 0;
    for (int q = ref + 1; q < e->size; q++) {
        parsed_t pq;
        if (!t->records[q]) continue;
        if (cring__record_parse(t->records[q], t->lens[q], &pq) != 0 ||
            cring__record_difference(p0, ref, &pq, q, bad < 0 ? why : scratch, sizeof why) > 0) {
            if (bad < 0) bad = q;
            nbad++;
            if (oo < sizeof others - 16)
                oo += (size_t)snprintf(others + oo, sizeof others - oo, "%s%d", oo ? ", " : "", q);
        }
    }
    if (bad >= 0) {
        int m = snprintf(msg, n,
                         "ranks disagree on tensor '%s': rank %d vs rank %d: %s (rank %d first)",
                         t->name, ref, bad, why, ref);
        if (nbad > 1 && m > 0 && (size_t)m < n)
            snprintf(msg + m, n - (size_t)m, "; ranks that differ from rank %d: [%s]", ref, others);
        return CRING_ERR_MISMATCH;
    }
    if (cring__join_conflict(e, t->records[ref], t->lens[ref], msg, n)) return CRING_ERR_MISMATCH;
    return CRING_OK;
}

cring_status_t cring__table_answer(cring_engine_t *e, table_entry_t *t, response_list_t *l) {
    const int P = e->size;
    cring_status_t st = CRING_OK;
    req_t *local = cring__strmap_get(&e->neg.pending, t->name);
    int ref = 0;
    while (ref < P && !t->records[ref]) ref++;
    parsed_t p0;
    if (ref == P || cring__record_parse(t->records[ref], t->lens[ref], &p0) != 0) goto done;
    char msg[CRING__MAX_NAME_BYTES + 1024];
    cring_status_t verdict = check_agreement(e, t, ref, &p0, msg, sizeof msg);
    if (verdict != CRING_OK) {
        st = fail_local(e, t, l, verdict, msg);
        goto done;
    }
    req_t *r = local ? local : cring__join_ghost(e, t->records[ref], t->lens[ref]);
    response_t *out = r ? cring__response_add(l) : NULL;
    if (!out) {
        if (!local) cring__req_free(r);
        st = CRING_ERR_NO_MEMORY;
        goto done;
    }
    out->req = r;
    out->owned_dims = malloc(sizeof(int64_t) * (size_t)(p0.ntensors ? p0.ntensors : 1) * (size_t)P);
    if (out->owned_dims) {
        for (int q = 0; q < P; q++) {
            parsed_t pq;
            cring__record_parse(t->records[q] ? t->records[q] : t->records[ref],
                                t->records[q] ? t->lens[q] : t->lens[ref], &pq);
            cring__record_first_dims(&pq, q, P, out->owned_dims);
        }
    }
    out->first_dims = out->owned_dims;
    cache_insert(e, r, out->owned_dims);
done:
    cring__table_entry_free(t, P);
    return st;
}

int cring__table_entry_complete(const cring_engine_t *e, const table_entry_t *t) {
    for (int q = 0; q < e->size; q++)
        if (!t->records[q] && !e->join.joined[q]) return 0;
    return 1;
}

/* "0, 2, 5": the ranks that described t (present) or did not (missing). */
static void rank_lists(const cring_engine_t *e, const table_entry_t *t, char *present,
                       char *missing, size_t n) {
    size_t po = 0, mo = 0;
    present[0] = missing[0] = 0;
    for (int r = 0; r < e->size; r++) {
        char *buf = t->records[r] ? present : missing;
        size_t *o = t->records[r] ? &po : &mo;
        if (*o < n - 16) *o += (size_t)snprintf(buf + *o, n - *o, "%s%d", *o ? ", " : "", r);
    }
}

/* ---- time-outs ---------------------------------------------------------------------
 * A name some ranks never submit would wait forever. Rank 0 alone decides
 * when it has waited past the communicator's time-out (from its own table,
 * its own clock) and sends the verdict as a record in the next exchange;
 * every rank applies it at the same point of the same round, so the same
 * entry fails everywhere and a late submission of the name starts afresh. */

void cring__table_check_timeouts(cring_engine_t *e, double now) {
    if (e->rank != 0 || e->neg.timeout_s <= 0) return;
    for (size_t b = 0; b < e->table.map.nbuckets; b++)
        for (cring__strmap_entry_t *x = e->table.map.buckets[b]; x; x = x->next) {
            table_entry_t *t = x->value;
            if (t->timeout_sent) continue;
            double since = t->first_seen_s;
            req_t *local = cring__strmap_get(&e->neg.pending, t->name);
            if (local && local->submit_s < since) since = local->submit_s;
            if (now - since < e->neg.timeout_s) continue;
            if (e->table.ntimeouts == e->table.cap_timeouts) {
                size_t cap = e->table.cap_timeouts ? 2 * e->table.cap_timeouts : 16;
                char **nt = realloc(e->table.timeouts, cap * sizeof *nt);
                if (!nt) return;
                e->table.timeouts = nt;
                e->table.cap_timeouts = cap;
            }
            char *name = strdup(t->name);
            if (!name) return;
            e->table.timeouts[e->table.ntimeouts++] = name;
            t->timeout_sent = 1;
        }
}

/* Apply rank 0's verdict: fail t on this rank (if it submitted) and drop it. */
static cring_status_t time_out_entry(cring_engine_t *e, table_entry_t *t, response_list_t *l) {
    char present[512], missing[512], msg[CRING__MAX_NAME_BYTES + 1200];
    rank_lists(e, t, present, missing, sizeof present);
    snprintf(msg, sizeof msg,
             "tensor '%s' timed out: ranks [%s] did not submit it within "
             "CRING_TIMEOUT_SECONDS=%g (submitted by ranks [%s]; rank 0 decided)",
             t->name, missing, e->neg.timeout_s, present);
    cring_status_t st = fail_local(e, t, l, CRING_ERR_TIMEOUT, msg);
    cring__table_entry_free(t, e->size);
    return st;
}

/* ---- the record exchange ------------------------------------------------------------ */

/* This rank's block: [u32 len | record] per verdict (rank 0), then per
 * uncached request. Empties both lists. */
static uint8_t *build_block(cring_engine_t *e, uint64_t *len_out) {
    uint64_t len = 0;
    for (size_t i = 0; i < e->table.ntimeouts; i++)
        len += 4 + CRING__RECORD_FIXED_BYTES + strlen(e->table.timeouts[i]);
    for (size_t i = 0; i < e->neg.nuncached; i++) len += 4 + e->neg.uncached[i]->record_len;
    uint8_t *mine = malloc(len ? len : 1), *p = mine;
    if (!mine) return NULL;
    for (size_t i = 0; i < e->table.ntimeouts; i++) {
        const char *name = e->table.timeouts[i];
        size_t name_len = strlen(name);
        cring__wire_put(&p, CRING__RECORD_FIXED_BYTES + name_len, 4);
        cring__wire_put(&p, name_len, 2);
        memcpy(p, name, name_len);
        p += name_len;
        /* collective RECORD_TIMEOUT_VERDICT, no tensors */
        memset(p, 0, CRING__RECORD_FIXED_BYTES - 2);
        p += CRING__RECORD_FIXED_BYTES - 2;
        free(e->table.timeouts[i]);
    }
    e->table.ntimeouts = 0;
    for (size_t i = 0; i < e->neg.nuncached; i++) {
        req_t *r = e->neg.uncached[i];
        cring__wire_put(&p, r->record_len, 4);
        memcpy(p, r->record, r->record_len);
        p += r->record_len;
    }
    e->neg.nuncached = 0;
    *len_out = len;
    return mine;
}

/* Feed rank r's record to the table; answer the entry once complete. */
static cring_status_t feed_record(cring_engine_t *e, int r, const uint8_t *rec, size_t len,
                                  const parsed_t *pr, double now, response_list_t *l) {
    const int P = e->size;
    char name[CRING__MAX_NAME_BYTES + 1];
    memcpy(name, pr->name, pr->name_len);
    name[pr->name_len] = 0;
    table_entry_t *t = cring__strmap_get(&e->table.map, name);
    if (pr->coll == RECORD_TIMEOUT_VERDICT) {
        if (r != 0) {
            cring__log(CRING__LOG_ERROR, e->rank, "malformed request record from rank %d", r);
            return CRING_OK;
        }
        if (!t) return CRING_OK; /* answered meanwhile, on every rank alike */
        cring__strmap_remove(&e->table.map, name);
        return time_out_entry(e, t, l);
    }
    if (!t) {
        t = calloc(1, sizeof *t);
        if (t) {
            t->name = strdup(name);
            t->records = calloc((size_t)P, sizeof *t->records);
            t->lens = calloc((size_t)P, sizeof *t->lens);
        }
        if (!t || !t->name || !t->records || !t->lens) {
            cring__table_entry_free(t, P);
            return CRING_ERR_NO_MEMORY;
        }
        t->first_seen_s = now;
        cring__strmap_put(&e->table.map, name, t);
    }
    if (!t->records[r]) t->have++;
    free(t->records[r]);
    t->records[r] = malloc(len);
    if (!t->records[r]) return CRING_ERR_NO_MEMORY;
    memcpy(t->records[r], rec, len);
    t->lens[r] = len;
    if (!cring__table_entry_complete(e, t)) return CRING_OK;
    cring__strmap_remove(&e->table.map, name);
    return cring__table_answer(e, t, l);
}

cring_status_t cring__table_exchange(cring_engine_t *e, response_list_t *l) {
    const int P = e->size;
    uint64_t my_len = 0;
    uint64_t *lens = calloc((size_t)P, sizeof *lens);
    size_t *sizes = calloc((size_t)P, sizeof *sizes);
    uint8_t *mine = build_block(e, &my_len), *all = NULL;
    cring_status_t st = CRING_OK;
    if (!lens || !sizes || !mine) {
        st = CRING_ERR_NO_MEMORY;
        goto done;
    }
    for (int r = 0; r < P; r++) sizes[r] = sizeof(uint64_t);
    st = cring__comm_allgatherv(e->comm, &my_len, sizeof my_len, lens, sizes);
    if (st != CRING_OK) goto done;
    size_t total = 0;
    for (int r = 0; r < P; r++) {
        sizes[r] = (size_t)lens[r];
        total += sizes[r];
    }
    all = malloc(total ? total : 1);
    if (!all) {
        st = CRING_ERR_NO_MEMORY;
        goto done;
    }
    st = cring__comm_allgatherv(e->comm, mine, (size_t)my_len, all, sizes);
    if (st != CRING_OK) goto done;

    double now = cring__now_coarse_s();
    size_t off = 0;
    for (int r = 0; r < P && st == CRING_OK; r++) {
        size_t end = off + sizes[r];
        while (off + 4 <= end && st == CRING_OK) {
            size_t len = (size_t)cring__wire_get(all + off, 4);
            off += 4;
            parsed_t pr;
            if (len > end - off || cring__record_parse(all + off, len, &pr) != 0) {
                cring__log(CRING__LOG_ERROR, e->rank, "malformed request record from rank %d", r);
                break;
            }
            st = feed_record(e, r, all + off, len, &pr, now, l);
            off += len;
        }
        off = end;
    }
done:
    free(lens);
    free(sizes);
    free(mine);
    free(all);
    return st;
}

/* The engine is going: free the table and the cache. */
void cring__table_free_all(cring_engine_t *e) {
    for (int i = 0; i < e->cache.capacity; i++) {
        e->cache.slots[i].local = NULL;
        cring__cache_evict(e, i);
    }
    free(e->cache.slots);
    free(e->cache.slot_state);
    e->cache.slots = NULL;
    e->cache.slot_state = NULL;
    e->cache.capacity = e->cache.nslots = 0;
    for (size_t b = 0; b < e->table.map.nbuckets; b++)
        for (cring__strmap_entry_t *x = e->table.map.buckets[b]; x; x = x->next)
            cring__table_entry_free(x->value, e->size);
    cring__strmap_free(&e->table.map);
    cring__strmap_free(&e->cache.index);
    for (size_t i = 0; i < e->table.ntimeouts; i++) free(e->table.timeouts[i]);
    free(e->table.timeouts);
    e->table.timeouts = NULL;
    e->table.ntimeouts = e->table.cap_timeouts = 0;
}
