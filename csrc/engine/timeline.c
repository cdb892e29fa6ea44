/* timeline.c: Chrome-trace JSON writer. Each tensor name gets its own track
 * (a "tid" with a thread_name metadata event) inside the rank's process
 * track; every event is written and the array closed and flushed at once.
 * Knows nothing of collectives beyond the strings it is given. */
#include "timeline.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "strmap.h"

struct cring__timeline {
    FILE *f;
    int rank;
    double t0;
    long close_pos; /* offset of the closing "]" */
    int nevents;
    int next_tid;
    cring__strmap_t tids;
};

static void json_escape(const char *in, char *out, size_t out_len) {
    size_t o = 0;
    for (; *in && o + 7 < out_len; in++) {
        unsigned char c = (unsigned char)*in;
        if (c == '"' || c == '\\') {
            out[o++] = '\\';
            out[o++] = (char)c;
        } else if (c < 0x20) {
            o += (size_t)snprintf(out + o, out_len - o, "\\u%04x", c);
        } else {
            out[o++] = (char)c;
        }
    }
    out[o] = 0;
}

/* Write one event and re-close the array. */
static void emit(cring__timeline_t *tl, const char *event) {
    fseek(tl->f, tl->close_pos, SEEK_SET);
    fprintf(tl->f, "%s%s", tl->nevents ? ",\n" : "\n", event);
    tl->close_pos = ftell(tl->f);
    fputs("\n]\n", tl->f);
    fflush(tl->f);
    tl->nevents++;
}

cring_status_t cring__timeline_open(const char *path, int rank, cring__timeline_t **out) {
    *out = NULL;
    cring__timeline_t *tl = calloc(1, sizeof *tl);
    if (!tl) return CRING_ERR_NO_MEMORY;
    tl->f = fopen(path, "w");
    if (!tl->f) {
        free(tl);
        return cring__fail(cring__thread_errmsg(), CRING_ERR_SYSTEM,
                           "cannot open timeline file %s", path);
    }
    tl->rank = rank;
    tl->t0 = cring__now_s();
    fputs("[", tl->f);
    tl->close_pos = ftell(tl->f);
    fputs("\n]\n", tl->f);
    fflush(tl->f);
    char ev[160];
    snprintf(ev, sizeof ev,
             "{\"name\": \"process_name\", \"ph\": \"M\", \"pid\": %d, \"args\": {\"name\": "
             "\"rank %d\"}}",
             rank, rank);
    emit(tl, ev);
    *out = tl;
    return CRING_OK;
}

void cring__timeline_close(cring__timeline_t *tl) {
    if (!tl) return;
    fclose(tl->f);
    cring__strmap_free(&tl->tids);
    free(tl);
}

static int tid_for(cring__timeline_t *tl, const char *name) {
    void *v = cring__strmap_get(&tl->tids, name);
    if (v) return (int)(intptr_t)v;
    int tid = ++tl->next_tid;
    cring__strmap_put(&tl->tids, name, (void *)(intptr_t)tid);
    char esc[512], ev[768];
    json_escape(name, esc, sizeof esc);
    snprintf(ev, sizeof ev,
             "{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": %d, \"tid\": %d, \"args\": "
             "{\"name\": \"%s\"}}",
             tl->rank, tid, esc);
    emit(tl, ev);
    return tid;
}

void cring__timeline_span(cring__timeline_t *tl, const char *name, const char *phase,
                          double start_s, double end_s, const char *args) {
    if (!tl) return;
    int tid = tid_for(tl, name);
    char ev[1024];
    double ts = (start_s - tl->t0) * 1e6, dur = (end_s - start_s) * 1e6;
    if (dur < 0) dur = 0;
    snprintf(ev, sizeof ev,
             "{\"name\": \"%s\", \"ph\": \"X\", \"pid\": %d, \"tid\": %d, \"ts\": %.3f, "
             "\"dur\": %.3f, \"args\": {%s}}",
             phase, tl->rank, tid, ts, dur, args ? args : "");
    emit(tl, ev);
}
