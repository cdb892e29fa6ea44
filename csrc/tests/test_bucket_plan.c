/* test_bucket_plan.c: the gradient bucket planner (csrc/engine/bucket_plan.c)
 * as a pure function, without an engine: plans learned from ready orders
 * (the same order every step, a changed order, a name missing from a step,
 * a new name, names of different dtypes, scalings and devices, two process
 * sets' planners side by side, zero-byte tensors, one huge tensor,
 * thousands of small ones), which requests are held and in which order held
 * ones go, and the release votes with the time passed in: idle only by the
 * plan's own names, never longer than CRING__HOLD_MAX_S whatever else
 * arrives, and the waiter's vote. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/bucket_plan.h"
#include "testutil.h"

#define MIB ((size_t)1 << 20)
#define THRESHOLD (64 * MIB)

static const cring__bucket_key_t F32 = {CRING_DEVICE_CUDA, CRING_FLOAT32, CRING_SUM, 1.0, 1.0};
static const cring__bucket_key_t F16 = {CRING_DEVICE_CUDA, CRING_FLOAT16, CRING_SUM, 1.0, 1.0};

/* ---- a sink that logs what goes, and helpers ------------------------------------------ */

#define LOG_MAX 32768
typedef struct {
    int n;
    const char *name[LOG_MAX]; /* the tokens are the names */
    const char *why[LOG_MAX];
    int bucket[LOG_MAX];
} log_t;

static log_t LOG;

static void log_release(void *ctx, void *token, const cring__bplan_release_t *info) {
    log_t *l = ctx;
    CHECK(l->n < LOG_MAX);
    l->name[l->n] = token;
    l->why[l->n] = info->why;
    l->bucket[l->n] = info->bucket;
    l->n++;
}

static const cring__bplan_sink_t SINK = {log_release, &LOG};

static void log_clear(void) { LOG.n = 0; }

/* The log holds exactly `names` (space-separated), in order, each for `why`. */
static int log_is(const char *names, const char *why) {
    char buf[4096];
    snprintf(buf, sizeof buf, "%s", names);
    int i = 0;
    for (char *tok = strtok(buf, " "); tok; tok = strtok(NULL, " "), i++)
        if (i >= LOG.n || strcmp(LOG.name[i], tok) != 0 || strcmp(LOG.why[i], why) != 0) {
            fprintf(stderr, "log entry %d: want %s (%s), have %s (%s)\n", i, tok, why,
                    i < LOG.n ? LOG.name[i] : "nothing", i < LOG.n ? LOG.why[i] : "");
            return 0;
        }
    if (i != LOG.n) fprintf(stderr, "log has %d entries, want %d\n", LOG.n, i);
    return i == LOG.n;
}

/* Names live as long as the test: tokens and plan names point at them. */
static char NAMES[21000][16];

static const char *nm(const char *prefix, int k) {
    static int used;
    CHECK(used < 21000);
    snprintf(NAMES[used], sizeof NAMES[used], "%s%d", prefix, k);
    return NAMES[used++];
}

static int LAST_READY; /* what the last ready_at returned */

static int ready_at(cring__bplan_t *p, const char *name, cring__bucket_key_t key, size_t bytes,
                    int release_all, double now_s) {
    cring__bplan_req_t r = {.name = name,
                            .name_hash = cring__strmap_hash(name),
                            .key = key,
                            .bytes = bytes,
                            .token = (void *)name};
    return LAST_READY = cring__bplan_ready(p, &r, THRESHOLD, release_all, now_s, &SINK);
}

/* One round that makes names[0..n) ready (each of `bytes`), at now_s, then
 * its end and its batch run. Returns how many the planner took. */
static int round_of(cring__bplan_t *p, const char *const *names, int n, size_t bytes,
                    double now_s) {
    int taken = 0;
    for (int i = 0; i < n; i++) taken += ready_at(p, names[i], F32, bytes, 0, now_s) != 0;
    cring__bplan_round_end(p, 0, 0, now_s, &SINK);
    cring__bplan_executed(p, now_s);
    return taken;
}

/* A step: every name in its own round, dt apart from t0. Returns how many were taken. */
static int step_of(cring__bplan_t *p, const char *const *names, int n, size_t bytes, double t0,
                   double dt) {
    int taken = 0;
    for (int i = 0; i < n; i++) taken += round_of(p, &names[i], 1, bytes, t0 + dt * i);
    return taken;
}

static const char *G[10];

static void init_g(void) {
    for (int k = 0; k < 10; k++) G[k] = nm("g", k);
}

/* ---- plans from ready orders -------------------------------------------------------------- */

/* Ten gradients of 10 MiB, the same order every step: the first step holds
 * nothing; from the second on, buckets of >= 25 MiB (three names) go when
 * complete, in plan order, and a bucket of one name is never held. */
static void same_order_every_step(void) {
    cring__bplan_t p = {0};
    log_clear();
    CHECK(step_of(&p, G, 10, 10 * MIB, 0.0, 0.01) == 0);
    CHECK(p.plans == 0 && p.nbuckets == 0 && LOG.n == 0);
    for (int s = 1; s <= 3; s++) {
        log_clear();
        double t = 10.0 * s;
        CHECK(round_of(&p, &G[0], 1, 10 * MIB, t) == 1); /* a new step: the plan, then held */
        CHECK(LAST_READY == CRING__BPLAN_HELD);
        CHECK(p.plans == (uint64_t)s);
        CHECK(p.nbuckets == 4);
        for (int k = 0; k < 10; k++) CHECK(cring__bplan_bucket_of(&p, G[k]) == (k < 9 ? k / 3 : 3));
        CHECK(p.buckets[3].n == 1);
        CHECK(LOG.n == 0 && p.nheld == 1);
        CHECK(round_of(&p, &G[1], 1, 10 * MIB, t + 0.01) == 1 && LOG.n == 0);
        CHECK(round_of(&p, &G[2], 1, 10 * MIB, t + 0.02) == 1);
        CHECK(LAST_READY == CRING__BPLAN_COMPLETED); /* it never waits */
        CHECK(log_is("g0 g1 g2", "complete") && p.nheld == 0);
        log_clear();
        CHECK(step_of(&p, &G[3], 6, 10 * MIB, t + 0.03, 0.01) == 6);
        CHECK(log_is("g3 g4 g5 g6 g7 g8", "complete"));
        CHECK(round_of(&p, &G[9], 1, 10 * MIB, t + 0.1) == 0); /* alone in its bucket */
        CHECK(p.nheld == 0);
    }
    cring__bplan_free(&p);
}

/* The order changes: the step still runs by the plan learned from the step
 * before (a bucket goes when its last name comes, in plan order), and the
 * next plan follows the new order. */
static void a_changed_order(void) {
    cring__bplan_t p = {0};
    const char *rev[10];
    for (int k = 0; k < 10; k++) rev[k] = G[9 - k];
    step_of(&p, G, 10, 10 * MIB, 0.0, 0.01);
    step_of(&p, G, 10, 10 * MIB, 1.0, 0.01);
    log_clear();
    CHECK(step_of(&p, rev, 10, 10 * MIB, 2.0, 0.01) == 9); /* g9 alone runs */
    CHECK(LOG.n == 9);
    CHECK(strcmp(LOG.name[0], "g6") == 0 && strcmp(LOG.name[2], "g8") == 0); /* plan order */
    CHECK(strcmp(LOG.name[3], "g3") == 0 && strcmp(LOG.name[6], "g0") == 0);
    log_clear();
    CHECK(round_of(&p, &rev[0], 1, 10 * MIB, 3.0) == 1); /* the plan of the reversed step */
    CHECK(cring__bplan_bucket_of(&p, "g9") == 0 && cring__bplan_bucket_of(&p, "g7") == 0);
    CHECK(cring__bplan_bucket_of(&p, "g6") == 1 && cring__bplan_bucket_of(&p, "g4") == 1);
    CHECK(cring__bplan_bucket_of(&p, "g0") == 3 && p.buckets[3].n == 1);
    CHECK(step_of(&p, &rev[1], 9, 10 * MIB, 3.01, 0.01) == 8);
    CHECK(LOG.n == 9 && strcmp(LOG.name[0], "g9") == 0 && p.nheld == 0);
    cring__bplan_free(&p);
}

/* A step without g4: its bucket's other names wait until the next step
 * begins, then go by the old plan ("step"); the plan of a step that lacked
 * g4 leaves it out, and it is planned again only once two steps in a row
 * had it. */
static void a_name_missing_from_a_step(void) {
    cring__bplan_t p = {0};
    const char *no4[9] = {G[0], G[1], G[2], G[3], G[5], G[6], G[7], G[8], G[9]};
    step_of(&p, G, 10, 10 * MIB, 0.0, 0.01);
    step_of(&p, G, 10, 10 * MIB, 1.0, 0.01);
    log_clear();
    CHECK(step_of(&p, no4, 9, 10 * MIB, 2.0, 0.01) == 8);
    CHECK(p.nheld == 2); /* g3 and g5 wait for g4 */
    CHECK(log_is("g0 g1 g2 g6 g7 g8", "complete"));
    log_clear();
    CHECK(round_of(&p, &G[0], 1, 10 * MIB, 3.0) == 1); /* the next step begins */
    CHECK(log_is("g3 g5", "step"));
    CHECK(cring__bplan_bucket_of(&p, "g4") == -1);
    CHECK(cring__bplan_bucket_of(&p, "g5") == cring__bplan_bucket_of(&p, "g3"));
    CHECK(cring__bplan_bucket_of(&p, "g6") == cring__bplan_bucket_of(&p, "g3"));
    CHECK(p.nbuckets == 3);
    log_clear();
    CHECK(step_of(&p, &G[1], 9, 10 * MIB, 3.01, 0.01) == 8); /* g4 back: not planned, runs */
    CHECK(LOG.n == 9 && p.nheld == 0);
    step_of(&p, G, 10, 10 * MIB, 4.0, 0.01);
    CHECK(cring__bplan_bucket_of(&p, "g4") == -1); /* the step before lacked it */
    step_of(&p, G, 10, 10 * MIB, 5.0, 0.01);
    CHECK(cring__bplan_bucket_of(&p, "g4") == 1); /* two steps had it */
    cring__bplan_free(&p);
}

/* A new name is never held until two steps in a row had it. */
static void a_new_name(void) {
    cring__bplan_t p = {0};
    const char *with_new[11];
    for (int k = 0; k < 10; k++) with_new[k < 5 ? k : k + 1] = G[k];
    with_new[5] = nm("new", 0);
    step_of(&p, G, 10, 10 * MIB, 0.0, 0.01);
    step_of(&p, G, 10, 10 * MIB, 1.0, 0.01);
    log_clear();
    CHECK(step_of(&p, with_new, 11, 10 * MIB, 2.0, 0.01) == 9); /* new and g9 run */
    CHECK(cring__bplan_bucket_of(&p, with_new[5]) == -1);
    CHECK(step_of(&p, with_new, 11, 10 * MIB, 3.0, 0.01) == 9);
    CHECK(cring__bplan_bucket_of(&p, with_new[5]) == -1); /* the step before lacked it */
    CHECK(step_of(&p, with_new, 11, 10 * MIB, 4.0, 0.01) >= 9);
    CHECK(cring__bplan_bucket_of(&p, with_new[5]) >= 0);
    CHECK(cring__bplan_bucket_of(&p, with_new[5]) == cring__bplan_bucket_of(&p, "g4"));
    CHECK(p.nheld == 0);
    cring__bplan_free(&p);
}

/* Names of two dtypes interleaved: each bucket holds one key, in each key's
 * own order; twenty keys at once (more than are open while a plan is cut)
 * still plan every name into a bucket of one key. A CPU-device key and a
 * scaled one are keys of their own. */
static void names_of_different_keys(void) {
    cring__bplan_t p = {0};
    const char *order[12];
    for (int k = 0; k < 6; k++) {
        order[2 * k] = nm("a", k);
        order[2 * k + 1] = nm("h", k);
    }
    for (int s = 0; s < 3; s++)
        for (int i = 0; i < 12; i++) {
            ready_at(&p, order[i], i % 2 ? F16 : F32, 10 * MIB, 0, s + 0.01 * i);
            cring__bplan_round_end(&p, 0, 0, s + 0.01 * i, &SINK);
        }
    CHECK(p.nbuckets == 4);
    CHECK(cring__bplan_bucket_of(&p, order[0]) == cring__bplan_bucket_of(&p, order[4]));
    CHECK(cring__bplan_bucket_of(&p, order[1]) == cring__bplan_bucket_of(&p, order[5]));
    CHECK(cring__bplan_bucket_of(&p, order[0]) != cring__bplan_bucket_of(&p, order[1]));
    CHECK(cring__bplan_bucket_of(&p, order[6]) != cring__bplan_bucket_of(&p, order[4]));
    cring__bplan_free(&p);

    /* twenty keys (scalings), round-robin, 200 names of 1 MiB; then keys
     * that differ only in device type or op */
    enum { N = 200, KEYS = 20 };
    const char *many[N];
    cring__bucket_key_t keys[N];
    for (int i = 0; i < N; i++) {
        many[i] = nm("k", i);
        keys[i] = F32;
        keys[i].prescale = 1.0 + i % KEYS;
        if (i % KEYS == 3) keys[i].device_type = CRING_DEVICE_CPU, keys[i].prescale = 1.0;
        if (i % KEYS == 4) keys[i].op = CRING_AVERAGE, keys[i].prescale = 1.0;
    }
    for (int s = 0; s < 2; s++)
        for (int i = 0; i < N; i++) ready_at(&p, many[i], keys[i], MIB, 0, s + 1e-4 * i);
    int total = 0;
    for (int b = 0; b < p.nbuckets; b++) total += p.buckets[b].n;
    CHECK(total == N);
    for (int i = 0; i < N; i++) {
        int b = cring__bplan_bucket_of(&p, many[i]);
        CHECK(b >= 0);
        for (int j = 0; j < N; j++)
            if (cring__bplan_bucket_of(&p, many[j]) == b)
                CHECK(j % KEYS == i % KEYS); /* one key per bucket */
    }
    cring__bplan_release_all(&p, "fail", &SINK);
    cring__bplan_free(&p);
}

/* Two process sets: each engine has its own planner, and the same names in
 * other orders do not disturb each other's plan. */
static void two_process_sets(void) {
    cring__bplan_t a = {0}, b = {0};
    const char *rev[10];
    for (int k = 0; k < 10; k++) rev[k] = G[9 - k];
    for (int s = 0; s < 3; s++) {
        log_clear();
        for (int i = 0; i < 10; i++) {
            round_of(&a, &G[i], 1, 10 * MIB, s + 0.01 * i);
            round_of(&b, &rev[i], 1, 10 * MIB, s + 0.01 * i);
        }
        CHECK(a.nheld == 0 && b.nheld == 0);
    }
    CHECK(cring__bplan_bucket_of(&a, "g0") == 0 && cring__bplan_bucket_of(&b, "g9") == 0);
    CHECK(cring__bplan_bucket_of(&a, "g9") == 3 && cring__bplan_bucket_of(&b, "g0") == 3);
    cring__bplan_free(&a);
    cring__bplan_free(&b);
}

/* Zero-byte tensors share a bucket and go with it; a step of nothing but
 * empty tensors is one bucket (no division by its size). */
static void zero_byte_tensors(void) {
    cring__bplan_t p = {0};
    const char *z[10];
    for (int k = 0; k < 10; k++) z[k] = nm("z", k);
    step_of(&p, z, 10, 0, 0.0, 0.01);
    log_clear();
    CHECK(step_of(&p, z, 10, 0, 1.0, 0.01) == 10);
    CHECK(p.nbuckets == 1 && p.buckets[0].n == 10 && p.buckets[0].bytes == 0);
    CHECK(log_is("z0 z1 z2 z3 z4 z5 z6 z7 z8 z9", "complete"));
    cring__bplan_free(&p);

    /* with real ones: [g0 g1 g2] [z0 .. z9 g3 g4 g5] ... */
    const char *mixed[20];
    int n = 0;
    for (int k = 0; k < 3; k++) mixed[n++] = G[k];
    for (int k = 0; k < 10; k++) mixed[n++] = z[k];
    for (int k = 3; k < 10; k++) mixed[n++] = G[k];
    for (int s = 0; s < 3; s++) {
        log_clear();
        for (int i = 0; i < n; i++) {
            int empty = i >= 3 && i < 13;
            ready_at(&p, mixed[i], F32, empty ? 0 : 10 * MIB, 0, s + 0.01 * i);
        }
        cring__bplan_round_end(&p, 0, 0, s + 0.2, &SINK);
    }
    CHECK(cring__bplan_bucket_of(&p, "z0") == cring__bplan_bucket_of(&p, "g5"));
    CHECK(cring__bplan_bucket_of(&p, "z0") != cring__bplan_bucket_of(&p, "g2"));
    CHECK(LOG.n == 19 && p.nheld == 0); /* all but g9, alone in its bucket */
    cring__bplan_free(&p);
}

/* One tensor larger than the threshold is a bucket of its own (never held)
 * and closes the bucket before it. */
static void one_huge_tensor(void) {
    cring__bplan_t p = {0};
    const char *names[11];
    for (int k = 0; k < 5; k++) names[k] = nm("s", k);
    names[5] = nm("huge", 0);
    for (int k = 5; k < 10; k++) names[k + 1] = nm("s", k);
    for (int s = 0; s < 3; s++) {
        log_clear();
        for (int i = 0; i < 11; i++) {
            int taken = ready_at(&p, names[i], F32, i == 5 ? 1024 * MIB : MIB, 0, s + 0.01 * i);
            if (s > 0 && i == 5) CHECK(taken == 0);
            cring__bplan_round_end(&p, 0, 0, s + 0.01 * i, &SINK);
        }
        CHECK(p.nheld == 0);
    }
    CHECK(p.nbuckets == 3);
    CHECK(cring__bplan_bucket_of(&p, "huge0") == 1 && p.buckets[1].n == 1);
    CHECK(p.buckets[1].bytes == 1024 * MIB);
    CHECK(cring__bplan_bucket_of(&p, "s4") == 0 && cring__bplan_bucket_of(&p, "s5") == 2);
    CHECK(log_is("s0 s1 s2 s3 s4 s5 s6 s7 s8 s9", "complete"));
    cring__bplan_free(&p);
}

/* Thousands of small gradients: 5000 of 4 KiB are one bucket, held until
 * the last comes, then go in plan order; 20000 make buckets of 25 MiB
 * (6400 names). A stream of names that never repeat builds no plan and
 * keeps a bounded recording. */
static void thousands_of_small_ones(void) {
    enum { N = 20000 };
    static const char *small[N];
    for (int i = 0; i < N; i++) small[i] = nm("t", i);
    cring__bplan_t p = {0};
    step_of(&p, small, 5000, 4096, 0.0, 1e-5);
    log_clear();
    CHECK(step_of(&p, small, 4999, 4096, 1.0, 1e-5) == 4999 && LOG.n == 0);
    CHECK(round_of(&p, &small[4999], 1, 4096, 1.1) == 1 && LAST_READY == CRING__BPLAN_COMPLETED);
    CHECK(p.nbuckets == 1 && LOG.n == 5000 && p.nheld == 0);
    for (int i = 0; i < 5000; i++) CHECK(LOG.name[i] == small[i]);
    cring__bplan_free(&p);

    step_of(&p, small, N, 4096, 0.0, 1e-6);
    log_clear();
    CHECK(step_of(&p, small, N, 4096, 1.0, 1e-6) == N);
    CHECK(p.nbuckets == 4);
    CHECK(p.buckets[0].n == 6400 && p.buckets[2].n == 6400 && p.buckets[3].n == 800);
    CHECK(LOG.n == N && p.nheld == 0);
    cring__bplan_free(&p);

    /* 70000 names, none twice: no step, no plan, nothing held */
    for (int i = 0; i < 70000; i++) {
        char name[32];
        snprintf(name, sizeof name, "once%d", i);
        CHECK(ready_at(&p, name, F32, 4096, 0, 1e-6 * i) == 0);
    }
    CHECK(p.plans == 0 && p.nrec <= 65536 && p.nheld == 0);
    cring__bplan_free(&p);
}

/* ---- the release rules ----------------------------------------------------------------- */

static int submitted_none(const void *ctx, const char *name) {
    (void)ctx, (void)name;
    return 0;
}

static int submitted_listed(const void *ctx, const char *name) {
    for (const char *const *n = ctx; *n; n++)
        if (strcmp(*n, name) == 0) return 1;
    return 0;
}

/* The idle vote: nothing of the plan for CRING__HOLD_IDLE_S while
 * something is held; its release goes as "idle" and cuts the plan there, so
 * names that came apart are learned as two buckets. */
static void an_idle_release_cuts_the_plan(void) {
    cring__bplan_t p = {0};
    step_of(&p, G, 10, 10 * MIB, 0.0, 0.01);
    step_of(&p, G, 10, 10 * MIB, 1.0, 0.01);
    log_clear();
    CHECK(round_of(&p, G, 2, 10 * MIB, 10.0) == 2); /* g0 and g1 held at 10.0 */
    CHECK(cring__bplan_vote(&p, 10.1, NULL) == 0);
    CHECK(cring__bplan_vote(&p, 10.19, NULL) == 0);
    CHECK(cring__bplan_vote(&p, 10.21, NULL) == CRING__RELEASE_IDLE);
    /* every rank saw some rank's idle vote: everything goes, and the plan is cut there */
    cring__bplan_round_end(&p, 1, 1, 10.21, &SINK);
    CHECK(log_is("g0 g1", "idle") && p.nheld == 0);
    CHECK(cring__bplan_vote(&p, 11.0, NULL) == 0); /* nothing held */
    log_clear();
    CHECK(step_of(&p, &G[2], 8, 10 * MIB, 11.0, 0.01) == 7);
    step_of(&p, G, 10, 10 * MIB, 12.0, 0.01);
    CHECK(cring__bplan_bucket_of(&p, "g0") == cring__bplan_bucket_of(&p, "g1"));
    CHECK(cring__bplan_bucket_of(&p, "g1") != cring__bplan_bucket_of(&p, "g2"));
    CHECK(cring__bplan_bucket_of(&p, "g2") == cring__bplan_bucket_of(&p, "g4"));
    cring__bplan_free(&p);
}

/* Only the plan's own names restart the idle clock (issue 33, finding 4):
 * batches without them (CPU collectives, other CUDA names) and names
 * outside the plan never do, so other traffic cannot keep a bucket held. */
static void idle_counts_only_the_plan(void) {
    cring__bplan_t p = {0};
    step_of(&p, G, 10, 10 * MIB, 0.0, 0.01);
    step_of(&p, G, 10, 10 * MIB, 1.0, 0.01);
    log_clear();
    CHECK(round_of(&p, G, 2, 10 * MIB, 10.0) == 2); /* g0 and g1 held at 10.0 */
    CHECK(cring__bplan_vote(&p, 10.1, NULL) == 0);
    for (double t = 10.0; t < 10.5; t += 0.01) { /* other work, every 10 ms */
        cring__bplan_round_end(&p, 0, 0, t, &SINK);
        cring__bplan_executed(&p, t);
    }
    CHECK(ready_at(&p, "other", F32, MIB, 0, 10.3) == 0); /* a name outside the plan */
    cring__bplan_round_end(&p, 0, 0, 10.3, &SINK);
    cring__bplan_executed(&p, 10.3);
    CHECK(cring__bplan_vote(&p, 10.19, NULL) == 0);
    CHECK(cring__bplan_vote(&p, 10.21, NULL) == CRING__RELEASE_IDLE);
    CHECK(cring__bplan_vote(&p, 10.5, NULL) == CRING__RELEASE_IDLE);
    cring__bplan_round_end(&p, 1, 1, 10.5, &SINK);
    CHECK(log_is("g0 g1", "idle") && p.nheld == 0);
    step_of(&p, &G[2], 8, 10 * MIB, 11.0, 0.01);
    step_of(&p, G, 10, 10 * MIB, 12.0, 0.01);
    step_of(&p, G, 10, 10 * MIB, 13.0, 0.01); /* the plan of an uncut step: [g0 g1 g2] */
    /* a batch of the plan's names restarts the clock once it has run; other
     * batches do not */
    log_clear();
    CHECK(round_of(&p, &G[0], 1, 10 * MIB, 20.0) == 1);
    CHECK(round_of(&p, &G[1], 1, 10 * MIB, 20.1) == 1);
    cring__bplan_executed(&p, 20.25); /* nothing of the plan: no restart */
    CHECK(cring__bplan_vote(&p, 20.35, NULL) == CRING__RELEASE_IDLE);
    CHECK(ready_at(&p, "g3", F32, 10 * MIB, 0, 20.35) == CRING__BPLAN_HELD);
    cring__bplan_round_end(&p, 0, 0, 20.35, &SINK);
    cring__bplan_executed(&p, 20.5); /* a long batch of the step: not idle */
    CHECK(cring__bplan_vote(&p, 20.6, NULL) == 0);
    CHECK(cring__bplan_vote(&p, 20.71, NULL) == CRING__RELEASE_IDLE);
    cring__bplan_round_end(&p, 1, 0, 20.71, &SINK); /* another rank's waiter: "wanted" */
    CHECK(log_is("g0 g1 g3", "wanted") && p.nheld == 0);
    cring__bplan_free(&p);
}

/* The hard bound: the plan's names keep coming (every 0.15 s, never
 * completing the held bucket), yet the held request goes CRING__HOLD_MAX_S
 * after it was held. */
static void held_at_most_hold_max(void) {
    enum { N = 40 };
    const char *n[N];
    for (int i = 0; i < N; i++) n[i] = nm("m", i);
    cring__bplan_t p = {0};
    step_of(&p, n, N, 10 * MIB, 0.0, 0.01); /* 400 MiB: buckets of 50 MiB, five names */
    step_of(&p, n, N, 10 * MIB, 1.0, 0.01);
    CHECK(p.nbuckets == 8 && p.buckets[0].n == 5);
    log_clear();
    CHECK(round_of(&p, &n[0], 1, 10 * MIB, 10.0) == 1);
    double t = 10.0;
    int voted = 0;
    for (int i = 5; i < N && !voted; i++) {
        if (i % 5 == 4) continue; /* no bucket completes */
        t += 0.15;
        CHECK(round_of(&p, &n[i], 1, 10 * MIB, t) == 1);
        int v = cring__bplan_vote(&p, t + 0.01, NULL);
        CHECK(v == (t + 0.01 - 10.0 > CRING__HOLD_MAX_S ? CRING__RELEASE_IDLE : 0));
        voted = v != 0;
    }
    CHECK(voted && t - 10.0 < CRING__HOLD_MAX_S + 0.2);
    cring__bplan_round_end(&p, 1, 1, t + 0.01, &SINK);
    CHECK(p.nheld == 0 && strcmp(LOG.name[0], "m0") == 0 && strcmp(LOG.why[0], "idle") == 0);
    cring__bplan_free(&p);
}

/* The waiter's vote: a thread here waits while a bucket misses a name this
 * rank has not submitted (it submits nothing more while it waits). */
static void the_waiters_vote(void) {
    cring__bplan_t p = {0};
    cring__bplan_waiter_t none = {.submitted = submitted_none};
    CHECK(cring__bplan_vote(&p, 0.0, &none) == 0); /* no plan */
    step_of(&p, G, 10, 10 * MIB, 0.0, 0.01);
    step_of(&p, G, 10, 10 * MIB, 1.0, 0.01);
    /* a lone call of g1, waited on before it is ready: its bucket misses g0, g2 */
    cring__bplan_waiter_t w = {
        .name = "g1", .name_hash = cring__strmap_hash("g1"), .submitted = submitted_none};
    CHECK(cring__bplan_vote(&p, 2.0, &w) == CRING__RELEASE_WAITER);
    static const char *const mates[] = {"g0", "g2", NULL};
    w.submitted = submitted_listed;
    w.ctx = mates;
    CHECK(cring__bplan_vote(&p, 2.0, &w) == 0); /* they are submitted: they will come */
    /* g9 is a bucket of one, and nothing is held: no vote */
    w = (cring__bplan_waiter_t){
        .name = "g9", .name_hash = cring__strmap_hash("g9"), .submitted = submitted_none};
    CHECK(cring__bplan_vote(&p, 2.0, &w) == 0);
    /* a CPU request waited on (no name of the planned kind) */
    CHECK(cring__bplan_vote(&p, 2.0, &none) == 0);
    log_clear();
    CHECK(round_of(&p, &G[3], 1, 10 * MIB, 2.0) == 1); /* a new step; g3 held */
    CHECK(cring__bplan_vote(&p, 2.05, NULL) == 0);
    CHECK(cring__bplan_vote(&p, 2.05, &none) == CRING__RELEASE_WAITER);
    static const char *const g4g5[] = {"g4", "g5", NULL};
    cring__bplan_waiter_t later = {.submitted = submitted_listed, .ctx = g4g5};
    CHECK(cring__bplan_vote(&p, 2.05, &later) == 0);
    /* the agreed flag: g4 runs now but counts for its bucket; g5 completes it */
    CHECK(ready_at(&p, "g4", F32, 10 * MIB, 1, 2.06) == 0);
    cring__bplan_round_end(&p, 1, 0, 2.06, &SINK);
    CHECK(log_is("g3", "wanted"));
    log_clear();
    CHECK(round_of(&p, &G[5], 1, 10 * MIB, 2.07) == 1 && LAST_READY == CRING__BPLAN_COMPLETED);
    CHECK(log_is("g5", "complete") && p.nheld == 0);
    /* a failure: everything held goes, and buckets fill anew */
    CHECK(round_of(&p, &G[6], 1, 10 * MIB, 2.08) == 1);
    log_clear();
    cring__bplan_release_all(&p, "fail", &SINK);
    cring__bplan_refill(&p);
    CHECK(log_is("g6", "fail") && p.nheld == 0 && p.buckets[2].nseen == 0);
    /* a join: forget everything, no plan, nothing held */
    cring__bplan_forget(&p);
    CHECK(p.nbuckets == 0 && cring__bplan_bucket_of(&p, "g0") == -1);
    CHECK(round_of(&p, G, 10, 10 * MIB, 3.0) == 0);
    cring__bplan_free(&p);
}

int main(void) {
    init_g();
    same_order_every_step();
    a_changed_order();
    a_name_missing_from_a_step();
    a_new_name();
    names_of_different_keys();
    two_process_sets();
    zero_byte_tensors();
    one_huge_tensor();
    thousands_of_small_ones();
    an_idle_release_cuts_the_plan();
    idle_counts_only_the_plan();
    held_at_most_hold_max();
    the_waiters_vote();
    printf("test_bucket_plan: %d checks passed\n", testutil_checks);
    return 0;
}
