/* bucket_plan.h: the gradient bucket planner (bucket_plan.c) as plain
 * functions of what they are given: the plan learned from the last step's
 * ready order, which ready request is held and which held ones go, and this
 * rank's vote for releasing everything. No engine, transport, clock or lock
 * in here: the caller (bucket.c) passes the time, the threshold and what it
 * knows of its waiters; a held request is an opaque token handed back through
 * a callback. Not thread-safe (the engine's driver owns one planner). */
#ifndef CRING_BUCKET_PLAN_H
#define CRING_BUCKET_PLAN_H

#include <stddef.h>
#include <stdint.h>

#include "cring/cring.h"
#include "strmap.h"

/* The size rule: a bucket closes once it holds CRING__BUCKET_BYTES (DDP's
 * default bucket_cap_mb=25) or a CRING__STEP_BUCKETS-th of the step's bytes,
 * whichever is more, and never holds more than the fusion threshold, since
 * one bucket is meant to be one NCCL call. So ResNet-50 (100 MB of float32
 * gradients) takes DDP's 4 buckets and ViT-B/16 (330 MB) 7 rather than 14:
 * on a GPU each bucket is its own launch (buckets complete in different
 * rounds as the backward pass runs), and past 8 a step's launches cost more
 * than the earlier start of smaller buckets gains. */
#define CRING__BUCKET_BYTES ((size_t)25 << 20)
#define CRING__STEP_BUCKETS 8
/* The release bounds (docs/gpu.md, "Gradient buckets"): a rank votes to
 * release everything held once no name of the plan became ready, went or
 * ran here for CRING__HOLD_IDLE_S, and in any case once a held request
 * became ready CRING__HOLD_MAX_S ago, whatever else runs. */
#define CRING__HOLD_IDLE_S 0.2
#define CRING__HOLD_MAX_S 2.0

/* What must be equal for two requests to share a bucket (the fusion key but
 * the device ordinal, which differs between ranks). */
typedef struct cring__bucket_key {
    int device_type;
    cring_dtype_t dtype;
    cring_op_t op;
    double prescale, postscale;
} cring__bucket_key_t;

typedef struct cring__bplan_entry {
    char *name;
    int bucket;
    int seen;      /* held or run in its bucket's current round of filling */
    void *held;    /* the caller's token while held, else NULL */
    double held_s; /* when it was held (the caller's clock) */
} cring__bplan_entry_t;

typedef struct cring__bplan_bucket {
    int first, n; /* its entries: members[first .. first + n) */
    int nseen, nheld;
    size_t bytes;
} cring__bplan_bucket_t;

typedef struct cring__bplan_rec {
    char *name;
    cring__bucket_key_t key;
    size_t bytes;
    int cut_before; /* an idle release of everything held came before it */
} cring__bplan_rec_t;

/* A planner; all zero is an empty one (no plan: nothing is held). The
 * fields are read by the caller and the tests, written only here. */
typedef struct cring__bplan {
    cring__bplan_entry_t *entries; /* the plan: one per planned name, in plan order */
    int nentries, cap_entries;
    cring__bplan_bucket_t *buckets;
    int nbuckets, cap_buckets;
    int *members;            /* entry indices grouped by bucket (buckets[b].first..) */
    cring__strmap_t index;   /* name -> entry + 1 */
    uint64_t plans;          /* plans built so far (the timeline names a bucket by it) */
    cring__bplan_rec_t *rec; /* this step's ready order, being recorded */
    int nrec, cap_rec;
    cring__strmap_t rec_index;  /* name -> 1 while in rec */
    cring__strmap_t prev_names; /* the last step's names (a plan takes only these) */
    int cut;                    /* the next recorded name starts a new bucket */
    int *held;                  /* entry indices of held requests, in the order held */
    int nheld;
    double last_plan_s; /* the idle clock: a name of the plan became ready, went or ran */
    int touched;        /* a name of the plan became ready or went since the last executed() */
    int round_ready;    /* a request came to ready() since the last round_end() */
} cring__bplan_t;

/* A ready request of the planned kind (a CUDA allreduce), as the caller
 * describes it; token is what comes back when a held request goes. */
typedef struct cring__bplan_req {
    const char *name;
    size_t name_hash; /* cring__strmap_hash(name) */
    cring__bucket_key_t key;
    size_t bytes;
    void *token;
} cring__bplan_req_t;

/* Why a held request goes, and what the timeline says of its bucket. */
typedef struct cring__bplan_release {
    const char *why; /* "complete", "step", "wanted", "idle", "join", "fail" */
    int bucket, bucket_tensors;
    size_t bucket_bytes;
    uint64_t plan;
} cring__bplan_release_t;

/* Where released tokens go, in release order (every rank releases the same
 * requests in the same order). The callback must take the token (run or
 * fail it); it must not call back into the planner. */
typedef struct cring__bplan_sink {
    void (*release)(void *ctx, void *token, const cring__bplan_release_t *info);
    void *ctx;
} cring__bplan_sink_t;

/* A request `r` became ready (on every rank, in the agreed order) at now_s.
 * Records it in this step's ready order; where it repeats a recorded name
 * a new step begins: everything held goes ("step") and the plan is rebuilt
 * from the step just ended (threshold: the fusion threshold in bytes).
 * Returns 0 when r runs now with the round (not in the plan, its bucket is
 * a single name, or release_all: the agreed flag, then it still counts for
 * its bucket); else the planner took r's token: CRING__BPLAN_HELD when it
 * waits for the rest of its bucket, CRING__BPLAN_COMPLETED when it
 * completed its bucket and went at once through `sink` with it. Held
 * requests of other buckets may go through `sink` either way. Never fails:
 * out of memory leaves a name unrecorded or the plan empty (nothing held). */
enum { CRING__BPLAN_HELD = 1, CRING__BPLAN_COMPLETED = 2 };
int cring__bplan_ready(cring__bplan_t *p, const cring__bplan_req_t *r, size_t threshold,
                       int release_all, double now_s, const cring__bplan_sink_t *sink);

/* The round's ready requests are all in. release_all (the agreed flag):
 * everything held goes, "idle" when idle (the flag of kind idle, which also
 * cuts the plan before the next recorded name) else "wanted". */
void cring__bplan_round_end(cring__bplan_t *p, int release_all, int idle, double now_s,
                            const cring__bplan_sink_t *sink);

/* The round's batch finished running at now_s: if it held names of the plan
 * (run or released), the idle clock restarts (a long collective of the step
 * is no idleness). Other work never touches the clock. */
void cring__bplan_executed(cring__bplan_t *p, double now_s);

/* What this rank knows of a thread waiting on one of its handles. */
typedef struct cring__bplan_waiter {
    /* the waited-on request's name when it is of the planned kind, else NULL */
    const char *name;
    size_t name_hash;
    /* 1 when this rank has submitted `name` (pending here, not yet ready) */
    int (*submitted)(const void *ctx, const char *name);
    const void *ctx;
} cring__bplan_waiter_t;

enum { CRING__RELEASE_WAITER = 1, CRING__RELEASE_IDLE = 2 };

/* This rank's vote at now_s for releasing everything held (waiter NULL:
 * no thread here waits on an unfinished handle):
 *   CRING__RELEASE_IDLE    something is held, and no name of the plan became
 *                          ready, went or ran for CRING__HOLD_IDLE_S, or the
 *                          oldest held request became ready CRING__HOLD_MAX_S
 *                          ago;
 *   CRING__RELEASE_WAITER  a thread waits (so this rank submits nothing more
 *                          for now) while a bucket with something held, or
 *                          the waited-on request's own (asked before it is
 *                          ready: a lone call is never held), misses a name
 *                          this rank has not submitted;
 *   0                      otherwise. */
int cring__bplan_vote(const cring__bplan_t *p, double now_s, const cring__bplan_waiter_t *waiter);

/* Everything held goes through sink with `why` (a join, a failure). */
void cring__bplan_release_all(cring__bplan_t *p, const char *why, const cring__bplan_sink_t *sink);

/* Every bucket starts filling anew (after a failure). Nothing may be held. */
void cring__bplan_refill(cring__bplan_t *p);

/* Forget the plan, the recording and the last step's names (learning starts
 * over). Nothing may be held (release it first). */
void cring__bplan_forget(cring__bplan_t *p);

/* The bucket of `name` in the current plan, or -1 when it is not planned. */
int cring__bplan_bucket_of(const cring__bplan_t *p, const char *name);

/* Free everything; the planner is empty (all zero) after. Nothing may be held. */
void cring__bplan_free(cring__bplan_t *p);

#endif
