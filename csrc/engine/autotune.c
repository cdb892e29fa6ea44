/* autotune.c: CRING_AUTOTUNE, tuning the fusion threshold and the cycle time
 * on the running job from its measured speed in steps per second, then
 * settling on the best. Owns the search (a pure function of scores), the
 * coordinator's windows and log, and the agreement every rank applies at the
 * same round. It never touches tensor data, and costs the default path two
 * flag tests per round (negotiate.c, execute.c).
 *
 * How it runs (every rank runs the same negotiation rounds in the same
 * order, so a round number means the same moment everywhere):
 *
 *   round:   ... r  r+1 ... s-1  [s]  s+1 ...  [s']  ...
 *                                 |              |
 *            sync round s: rank 0 closes its window when it is long enough
 *            (score: whole steps completed / their wall seconds), feeds the
 *            search when a trial is complete, and broadcasts 24 bytes: the
 *            knobs, the number of rounds to the next sync (about a quarter
 *            of a window at the current round rate) and whether tuning has
 *            settled. Every rank applies them before its next round.
 *
 *   trial:   [warm-up windows, discarded][scored windows] -> median score
 *
 * A step is one cycle of the job's work: the time from one completion of the
 * anchor to the next, the anchor being the first name the job completes a
 * second time (a training step completes each gradient once, so the anchor
 * is its first gradient). A window runs from one anchor completion to a later
 * one, so it holds whole steps only, whatever the knobs do to the rounds in
 * between, and names the job stopped using count for nothing:
 *
 *   anchor:  |-- step --|-- step --|-- step --|-- step --| ...
 *            ^ window start                    ^ last anchor before the sync
 *            score = steps / (last anchor - window start)
 *
 * The search, deterministic (the same scores give the same trials):
 *   1. baseline: the knobs the job started with;
 *   2. fusion threshold over a log grid (64 KiB .. 64 MiB, x16), cycle time
 *      as started, skipping the baseline's value;
 *   3. cycle time over {0, 0.25, 1, 4} ms at the best threshold so far,
 *      skipping the value already measured;
 *   4. confirm, when the best is not the start: the starting knobs and the
 *      best alternate for CRING__TUNE_CONFIRM_PAIRS pairs of trials; the
 *      best is kept only when the median of its per-pair speed-ups is at
 *      least CONFIRM_MARGIN and no pair measured it slower than the start,
 *      else the job keeps its starting knobs;
 *   then settle. In 2 and 3 a trial replaces the best only when it scores
 *   at least TUNE_MARGIN more. Once settled, the hooks are off.
 *
 * A window closes at the first sync round once it holds
 * CRING_AUTOTUNE_STEPS_PER_SAMPLE steps spanning CRING_AUTOTUNE_SAMPLE_SECONDS,
 * or after ten times that time whatever it holds (no step: score 0). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "engine_internal.h"

#define TUNE_MARGIN 0.03    /* a new best must score this much more */
#define CONFIRM_MARGIN 0.10 /* and be this much faster than the start, paired */
#define FIRST_SYNC_ROUNDS 8 /* the first window, before any round rate is known */
#define MAX_SYNC_ROUNDS (1u << 20)
#define PACKET_MAGIC 0x43524e47u /* "CRNG" */

static const uint64_t threshold_grid[] = {64u << 10, 1u << 20, 16u << 20, 64u << 20};
static const uint32_t cycle_grid_us[] = {0, 250, 1000, 4000};
#define SEEN_SLOTS 1024 /* names remembered while looking for the anchor */
#define NTHRESHOLDS (int)(sizeof threshold_grid / sizeof threshold_grid[0])
#define NCYCLES (int)(sizeof cycle_grid_us / sizeof cycle_grid_us[0])

/* ---- the search (pure) ---------------------------------------------------------------- */

void cring__tune_search_init(cring__tune_search_t *s, cring__tune_knobs_t start) {
    memset(s, 0, sizeof *s);
    s->start = s->current = s->best = start;
    s->phase = CRING__TUNE_BASELINE;
}

/* The confirmation (phase CONFIRM): the starting knobs and the best
 * alternate pair by pair, in the order start-best, best-start, start-best, so
 * that slow drift of a shared machine favours neither, and one lucky trial
 * cannot crown a winner. Trial i of the phase measures the best when: */
static int confirm_measures_best(int i) { return (i / 2) % 2 == 0 ? i % 2 == 1 : i % 2 == 0; }

static int confirm(cring__tune_search_t *s, double score) {
    int i = s->next++, pair = i / 2;
    if (confirm_measures_best(i)) s->confirm_best_score = score;
    else s->confirm_start_score = score;
    int last = pair + 1 == CRING__TUNE_CONFIRM_PAIRS && i % 2 == 1;
    if (!last) s->current = confirm_measures_best(i + 1) ? s->best : s->start;
    if (i % 2 == 0) return 0;
    double start = s->confirm_start_score, best = s->confirm_best_score;
    s->confirm_ratio[pair] = start > 0 ? best / start : best > 0 ? 2.0 : 1.0;
    if (!last) return 0;
    double ratios[CRING__TUNE_CONFIRM_PAIRS];
    memcpy(ratios, s->confirm_ratio, sizeof ratios);
    double median = cring__tune_median(ratios, CRING__TUNE_CONFIRM_PAIRS); /* sorts */
    if (median >= 1.0 + CONFIRM_MARGIN && ratios[0] >= 1.0) {
        s->best_score = best; /* the last trial measured it */
        s->best_trial = s->trials;
    } else { /* not clearly faster: keep what the job started with */
        s->best = s->start;
        s->best_score = start;
        s->best_trial = s->trials - 1;
    }
    s->phase = CRING__TUNE_SETTLED;
    s->current = s->best;
    return 1;
}

int cring__tune_search_step(cring__tune_search_t *s, double score) {
    if (s->phase == CRING__TUNE_SETTLED) return 1;
    s->trials++;
    if (s->phase == CRING__TUNE_CONFIRM) return confirm(s, score);
    if (s->trials == 1 || score > s->best_score * (1.0 + TUNE_MARGIN)) {
        s->best = s->current;
        s->best_score = score;
        s->best_trial = s->trials;
    }
    if (s->phase == CRING__TUNE_BASELINE) {
        s->phase = CRING__TUNE_THRESHOLD;
        s->next = 0;
    }
    if (s->phase == CRING__TUNE_THRESHOLD) {
        while (s->next < NTHRESHOLDS) {
            uint64_t t = threshold_grid[s->next++];
            if (t == s->start.fusion_threshold_bytes) continue; /* the baseline measured it */
            s->current = (cring__tune_knobs_t){t, s->start.cycle_time_us};
            return 0;
        }
        s->phase = CRING__TUNE_CYCLE;
        s->next = 0;
    }
    if (s->phase == CRING__TUNE_CYCLE) {
        while (s->next < NCYCLES) {
            uint32_t c = cycle_grid_us[s->next++];
            if (c == s->start.cycle_time_us) continue; /* measured with this threshold */
            s->current = (cring__tune_knobs_t){s->best.fusion_threshold_bytes, c};
            return 0;
        }
    }
    if (s->best.fusion_threshold_bytes != s->start.fusion_threshold_bytes ||
        s->best.cycle_time_us != s->start.cycle_time_us) {
        s->phase = CRING__TUNE_CONFIRM;
        s->next = 0;
        s->current = s->start;
        return 0;
    }
    s->phase = CRING__TUNE_SETTLED;
    s->current = s->best;
    return 1;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

double cring__tune_median(double *scores, int n) {
    if (n <= 0) return 0.0;
    qsort(scores, (size_t)n, sizeof *scores, cmp_double);
    return n % 2 ? scores[n / 2] : 0.5 * (scores[n / 2 - 1] + scores[n / 2]);
}

/* ---- the engine's side ------------------------------------------------------------------ */

static const char *phase_name(int phase) {
    switch (phase) {
    case CRING__TUNE_BASELINE: return "baseline";
    case CRING__TUNE_THRESHOLD: return "fusion_threshold";
    case CRING__TUNE_CYCLE: return "cycle_time";
    case CRING__TUNE_CONFIRM: return "confirm";
    default: return "best";
    }
}

static void publish(cring_engine_t *e, int state) {
    atomic_store(&e->tune.shown_threshold_bytes, (uint64_t)e->exec.threshold);
    double us = e->drive.cycle_time_s * 1e6 + 0.5;
    atomic_store(&e->tune.shown_cycle_time_us,
                 us > 0 ? (us < 4e9 ? (uint32_t)us : 4000000000u) : 0u);
    atomic_store(&e->tune.shown_state, state);
}

static void log_row(cring_engine_t *e, int trial, int phase, cring__tune_knobs_t k, double score) {
    cring__log(CRING__LOG_INFO, e->rank,
               "autotune: %s trial %d: threshold %llu B, cycle %g ms: %.4g steps/s",
               phase_name(phase), trial, (unsigned long long)k.fusion_threshold_bytes,
               k.cycle_time_us / 1000.0, score);
    if (!e->tune.log) return;
    fprintf(e->tune.log, "%d,%s,%llu,%g,%.4g\n", trial, phase_name(phase),
            (unsigned long long)k.fusion_threshold_bytes, k.cycle_time_us / 1000.0, score);
    fflush(e->tune.log);
}

void cring__autotune_start(cring_engine_t *e) {
    cring__tune_t *t = &e->tune;
    publish(e, CRING_AUTOTUNE_OFF);
    const char *on = getenv("CRING_AUTOTUNE");
    if (!on || !*on || !strcmp(on, "0") || !strcasecmp(on, "false") || !strcasecmp(on, "no") ||
        !strcasecmp(on, "off"))
        return;
    long warmup = cring__env_long("CRING_AUTOTUNE_WARMUP_SAMPLES", 1);
    long samples = cring__env_long("CRING_AUTOTUNE_SAMPLES", 3);
    double window_s = cring__env_double("CRING_AUTOTUNE_SAMPLE_SECONDS", 0.5);
    long steps = cring__env_long("CRING_AUTOTUNE_STEPS_PER_SAMPLE", 5);
    t->warmup_windows = warmup < 0 ? 0 : (int)CRING_MIN(warmup, 1000);
    t->sample_windows = (int)CRING_MAX(1, CRING_MIN(samples, CRING__TUNE_MAX_SAMPLES));
    t->window_s = window_s > 0 ? window_s : 0.5;
    t->steps_per_window = steps < 0 ? 0 : (int)CRING_MIN(steps, 1000000);
    double cycle_us = e->drive.cycle_time_s > 0 ? e->drive.cycle_time_s * 1e6 + 0.5 : 0;
    cring__tune_knobs_t start = {(uint64_t)e->exec.threshold,
                                 cycle_us < 4e9 ? (uint32_t)cycle_us : 4000000000u};
    cring__tune_search_init(&t->search, start);
    t->next_sync_round = e->drive.rounds_done + FIRST_SYNC_ROUNDS;
    t->window_start_s = t->last_sync_s = cring__now_s();
    t->last_sync_round = e->drive.rounds_done;
    const char *path = getenv("CRING_AUTOTUNE_LOG");
    if (e->rank == 0 && path && *path) {
        t->log = fopen(path, "w");
        if (!t->log)
            cring__log(CRING__LOG_WARNING, e->rank, "CRING_AUTOTUNE_LOG: cannot write %s", path);
        else fprintf(t->log, "trial,knob,fusion_threshold_bytes,cycle_time_ms,score_steps_per_s\n");
    }
    if (e->rank == 0 && !(t->seen = calloc(SEEN_SLOTS, sizeof *t->seen))) {
        cring__log(CRING__LOG_WARNING, e->rank, "autotune: out of memory; not tuning");
        if (t->log) fclose(t->log);
        t->log = NULL;
        return;
    }
    t->on = 1;
    publish(e, CRING_AUTOTUNE_TUNING);
}

void cring__autotune_stop(cring_engine_t *e) {
    if (e->tune.log) fclose(e->tune.log);
    e->tune.log = NULL;
    free(e->tune.seen);
    e->tune.seen = NULL;
    e->tune.on = 0;
}

static uint64_t name_hash(const char *name) {
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (const char *c = name ? name : ""; *c; c++) h = (h ^ (uint8_t)*c) * 1099511628211ull;
    return h ? h : 1; /* 0 marks an empty slot */
}

/* Until a name recurs, remember the names seen; the first one seen again is
 * the anchor. Returns 1 when `h` became the anchor. */
static int find_anchor(cring__tune_t *t, uint64_t h) {
    size_t i = (size_t)(h % SEEN_SLOTS);
    for (int probes = 0; probes < SEEN_SLOTS / 2; probes++, i = (i + 1) % SEEN_SLOTS) {
        if (t->seen[i] == h) break; /* seen before: a cycle of the job's work */
        if (t->seen[i] == 0) {
            t->seen[i] = h;
            return 0;
        }
    }
    /* recurred, or so many names without a repeat that any one will do */
    t->anchor = h;
    free(t->seen);
    t->seen = NULL;
    return 1;
}

void cring__autotune_count(cring_engine_t *e, const response_t *resp, int n) {
    cring__tune_t *t = &e->tune;
    if (e->rank != 0) return; /* the coordinator alone measures */
    for (int i = 0; i < n; i++) {
        const req_t *r = resp[i].req;
        if (resp[i].status != CRING_OK || !r->handle) continue; /* errors, joined stand-ins */
        uint64_t h = name_hash(r->name);
        if (t->anchor == h) {
            t->steps++;
            t->last_step_s = cring__now_s();
        } else if (!t->anchor && find_anchor(t, h)) {
            t->steps = 0; /* the first window starts at this completion */
            t->window_start_s = t->last_step_s = cring__now_s();
        }
    }
}

/* The decision that travels: the knobs, rounds to the next sync, settled. */
typedef struct packet {
    uint64_t threshold_bytes;
    uint32_t cycle_time_us, next_rounds, settled, magic;
} packet_t;

/* Rank 0 at a sync round: close the window when it is long enough, feed
 * the search when a trial is complete, and say what every rank runs next. */
static void decide(cring_engine_t *e, packet_t *p) {
    cring__tune_t *t = &e->tune;
    double now = cring__now_s();
    double elapsed = now - t->window_start_s;
    double span = t->last_step_s - t->window_start_s; /* whole steps only */
    uint64_t want = t->steps_per_window > 0 ? (uint64_t)t->steps_per_window : 1;
    int settled = 0;
    if (!t->anchor) {
        t->window_start_s = now; /* no step seen yet: nothing to score */
    } else if (elapsed >= 10 * t->window_s || (t->steps >= want && span >= t->window_s)) {
        double score = t->steps > 0 && span > 0 ? (double)t->steps / span : 0.0;
        if (t->window >= t->warmup_windows) t->samples[t->window - t->warmup_windows] = score;
        if (++t->window == t->warmup_windows + t->sample_windows) {
            double median = cring__tune_median(t->samples, t->sample_windows);
            int phase = t->search.phase;
            cring__tune_knobs_t measured = t->search.current;
            settled = cring__tune_search_step(&t->search, median);
            log_row(e, t->search.trials, phase, measured, median);
            if (settled)
                log_row(e, t->search.best_trial, CRING__TUNE_SETTLED, t->search.best,
                        t->search.best_score);
            t->window = 0;
        }
        /* the next window starts where this one's last whole step ended */
        t->window_start_s = t->steps > 0 ? t->last_step_s : now;
        t->steps = 0;
    }
    /* about four syncs per window, at the round rate since the last one;
     * growing at most twofold per sync, so that a burst of rounds (a cycle
     * time of 0 runs a round per gradient) cannot put the next sync, and so
     * the end of the window, minutes away */
    double since = now - t->last_sync_s;
    uint64_t rounds = e->drive.rounds_done - t->last_sync_round;
    double next = since > 0 ? (double)rounds / since * t->window_s / 4 : 1.0;
    if (next > 2.0 * (double)(rounds ? rounds : 1)) next = 2.0 * (double)(rounds ? rounds : 1);
    t->last_sync_s = now;
    t->last_sync_round = e->drive.rounds_done;
    p->threshold_bytes = t->search.current.fusion_threshold_bytes;
    p->cycle_time_us = t->search.current.cycle_time_us;
    p->next_rounds = next < 1 ? 1u : next > MAX_SYNC_ROUNDS ? MAX_SYNC_ROUNDS : (uint32_t)next;
    p->settled = (uint32_t)settled;
    p->magic = PACKET_MAGIC;
}

cring_status_t cring__autotune_round(cring_engine_t *e) {
    cring__tune_t *t = &e->tune;
    if (e->drive.rounds_done < t->next_sync_round) return CRING_OK;
    packet_t p;
    memset(&p, 0, sizeof p);
    if (e->rank == 0) decide(e, &p);
    if (e->size > 1) CRING_CHECK(cring__comm_broadcast(e->comm, &p, sizeof p, 0));
    if (p.magic != PACKET_MAGIC) return CRING_ERR_PROTOCOL;
    e->exec.threshold = (size_t)p.threshold_bytes;
    /* cycle_time_s is read unlocked by the engine thread between its rounds;
     * an aligned double is written whole, and a stale pace costs one cycle */
    e->drive.cycle_time_s = p.cycle_time_us / 1e6;
    t->next_sync_round = e->drive.rounds_done + p.next_rounds;
    if (p.settled) {
        t->on = 0;
        if (t->log) fclose(t->log);
        t->log = NULL;
        cring__log(CRING__LOG_INFO, e->rank,
                   "autotune settled: CRING_FUSION_THRESHOLD=%llu CRING_CYCLE_TIME=%g",
                   (unsigned long long)p.threshold_bytes, p.cycle_time_us / 1000.0);
    }
    publish(e, p.settled ? CRING_AUTOTUNE_SETTLED : CRING_AUTOTUNE_TUNING);
    return CRING_OK;
}
