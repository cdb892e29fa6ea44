/* timeline.c: Chrome-trace JSON writer in the layout of Horovod's timeline:
 * each tensor is a row of its own (a "pid" named by a process_name metadata
 * event, "allreduce.grad" for the tensor "grad" of an allreduce, sorted in
 * order of appearance), pid 0 names the writing rank, and cycle markers are
 * global instant events. Knows nothing of collectives beyond the strings it
 * is given.
 *
 * The file must be valid JSON whenever anyone reads it, even while it grows,
 * and a reader may hold it open for any time, so no file that was ever
 * visible is written again: each update builds a new file (the previous
 * one's events copied in the kernel, the new events appended, the closing
 * bracket) and renames it over the path. Only events not yet published are
 * kept in memory. Once the file is large, updates are spaced so that copying
 * costs at most a few percent of one core; closing publishes everything. */
#include "timeline.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "strmap.h"

static const char HEAD[] = "[\n", TAIL[] = "\n]\n";
#define SMALL_FILE_BYTES (4u << 20) /* below this, every flush publishes */

struct cring__timeline {
    char *path;
    char *tmp_path;
    int fd_visible;       /* read side of the file now at path */
    size_t visible_bytes; /* HEAD + published events (TAIL excluded) */
    double last_publish_s;
    int rank;
    double t0;
    char *buf; /* events not yet published, with separators */
    size_t len, cap;
    int nevents;
    int next_row;
    cring__strmap_t rows;   /* row label -> its pid */
    cring__strmap_t labels; /* tensor name -> its row label (malloc'd) */
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

static int write_all(int fd, const void *data, size_t n) {
    const char *p = data;
    while (n) {
        ssize_t w = write(fd, p, n);
        if (w < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

/* Copy the first n bytes of src into dst (in the kernel when it can). */
static int copy_prefix(int src, int dst, size_t n) {
    loff_t in_off = 0;
    while (n) {
        ssize_t c = copy_file_range(src, &in_off, dst, NULL, n, 0);
        if (c <= 0) break;
        n -= (size_t)c;
    }
    char chunk[65536];
    while (n) { /* no copy_file_range here: plain reads */
        ssize_t r = pread(src, chunk, n < sizeof chunk ? n : sizeof chunk, (off_t)in_off);
        if (r <= 0 || write_all(dst, chunk, (size_t)r) != 0) return -1;
        in_off += r;
        n -= (size_t)r;
    }
    return 0;
}

/* Build the next version of the file and rename it over the path. */
static int publish(cring__timeline_t *tl) {
    int fd = open(tl->tmp_path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) return -1;
    int ok = tl->fd_visible >= 0 ? copy_prefix(tl->fd_visible, fd, tl->visible_bytes) == 0
                                 : write_all(fd, HEAD, sizeof HEAD - 1) == 0;
    ok = ok && write_all(fd, tl->buf, tl->len) == 0 && write_all(fd, TAIL, sizeof TAIL - 1) == 0;
    if (!ok || rename(tl->tmp_path, tl->path) != 0) {
        close(fd);
        unlink(tl->tmp_path);
        return -1;
    }
    if (tl->fd_visible >= 0) close(tl->fd_visible);
    tl->fd_visible = fd;
    tl->visible_bytes = (tl->visible_bytes ? tl->visible_bytes : sizeof HEAD - 1) + tl->len;
    tl->len = 0;
    tl->last_publish_s = cring__now_s();
    return 0;
}

static void emit(cring__timeline_t *tl, const char *event) {
    size_t n = strlen(event) + 2;
    if (tl->len + n + 1 > tl->cap) {
        size_t cap = tl->cap ? tl->cap * 2 : 1 << 16;
        while (cap < tl->len + n + 1) cap *= 2;
        char *b = realloc(tl->buf, cap);
        if (!b) return; /* drop the event rather than fail the collective */
        tl->buf = b;
        tl->cap = cap;
    }
    tl->len += (size_t)snprintf(tl->buf + tl->len, tl->cap - tl->len, "%s%s",
                                tl->nevents ? ",\n" : "", event);
    tl->nevents++;
}

void cring__timeline_flush(cring__timeline_t *tl) {
    if (!tl || !tl->len) return;
    /* A large file is copied at each update: space updates so that copying
     * (roughly 1 GB/s) takes at most ~2% of the time. */
    if (tl->visible_bytes > SMALL_FILE_BYTES &&
        cring__now_s() - tl->last_publish_s < (double)tl->visible_bytes / 20e6)
        return;
    publish(tl);
}

cring_status_t cring__timeline_open(const char *path, int rank, cring__timeline_t **out) {
    *out = NULL;
    cring__timeline_t *tl = calloc(1, sizeof *tl);
    if (!tl) return CRING_ERR_NO_MEMORY;
    tl->fd_visible = -1;
    size_t plen = strlen(path);
    tl->path = malloc(plen + 1);
    tl->tmp_path = malloc(plen + 32);
    if (!tl->path || !tl->tmp_path) {
        cring__timeline_close(tl);
        return CRING_ERR_NO_MEMORY;
    }
    memcpy(tl->path, path, plen + 1);
    snprintf(tl->tmp_path, plen + 32, "%s.tmp.%d", path, (int)getpid());
    tl->rank = rank;
    tl->t0 = cring__now_s();
    struct timespec wall; /* where ts 0 is, in wall-clock time (Horovod's field) */
    clock_gettime(CLOCK_REALTIME, &wall);
    char ev[200];
    snprintf(ev, sizeof ev,
             "{\"name\": \"process_name\", \"ph\": \"M\", \"pid\": 0, \"args\": {\"name\": "
             "\"rank %d\", \"start_time_since_epoch_in_micros\": %lld}}",
             rank, (long long)wall.tv_sec * 1000000LL + wall.tv_nsec / 1000);
    emit(tl, ev);
    emit(tl, "{\"name\": \"process_sort_index\", \"ph\": \"M\", \"pid\": 0, \"args\": "
             "{\"sort_index\": 0}}");
    if (publish(tl) != 0) {
        int e = errno;
        cring__timeline_close(tl);
        return cring__fail(cring__thread_errmsg(), CRING_ERR_SYSTEM,
                           "cannot write timeline file %s: %s", path, strerror(e));
    }
    *out = tl;
    return CRING_OK;
}

void cring__timeline_close(cring__timeline_t *tl) {
    if (!tl) return;
    if (tl->len && tl->path) publish(tl);
    if (tl->fd_visible >= 0) close(tl->fd_visible);
    for (size_t b = 0; b < tl->labels.nbuckets; b++)
        for (cring__strmap_entry_t *x = tl->labels.buckets[b]; x; x = x->next) free(x->value);
    cring__strmap_free(&tl->labels);
    cring__strmap_free(&tl->rows);
    free(tl->buf);
    free(tl->path);
    free(tl->tmp_path);
    free(tl);
}

void cring__timeline_tensor(cring__timeline_t *tl, const char *name, const char *op) {
    if (!tl || cring__strmap_get(&tl->labels, name)) return;
    size_t olen = strlen(op), nlen = strlen(name);
    char *label = malloc(olen + nlen + 2);
    if (!label) return; /* the row keeps the bare name */
    if (strncmp(name, op, olen) == 0 && name[olen] == '.') memcpy(label, name, nlen + 1);
    else snprintf(label, olen + nlen + 2, "%s.%s", op, name);
    if (cring__strmap_put(&tl->labels, name, label) != 0) free(label);
}

static int row_for(cring__timeline_t *tl, const char *name) {
    const char *label = cring__strmap_get(&tl->labels, name);
    if (!label) label = name;
    void *v = cring__strmap_get(&tl->rows, label);
    if (v) return (int)(intptr_t)v;
    int pid = ++tl->next_row;
    cring__strmap_put(&tl->rows, label, (void *)(intptr_t)pid);
    char esc[512], ev[768];
    json_escape(label, esc, sizeof esc);
    snprintf(ev, sizeof ev,
             "{\"name\": \"process_name\", \"ph\": \"M\", \"pid\": %d, \"args\": "
             "{\"name\": \"%s\"}}",
             pid, esc);
    emit(tl, ev);
    snprintf(ev, sizeof ev,
             "{\"name\": \"process_sort_index\", \"ph\": \"M\", \"pid\": %d, \"args\": "
             "{\"sort_index\": %d}}",
             pid, pid);
    emit(tl, ev);
    return pid;
}

void cring__timeline_span(cring__timeline_t *tl, const char *name, const char *phase,
                          double start_s, double end_s, const char *args) {
    if (!tl) return;
    int pid = row_for(tl, name);
    char ev[1024];
    double ts = (start_s - tl->t0) * 1e6, dur = (end_s - start_s) * 1e6;
    if (dur < 0) dur = 0;
    snprintf(ev, sizeof ev,
             "{\"name\": \"%s\", \"ph\": \"X\", \"pid\": %d, \"tid\": 0, \"ts\": %.3f, "
             "\"dur\": %.3f, \"args\": {%s}}",
             phase, pid, ts, dur, args ? args : "");
    emit(tl, ev);
}

void cring__timeline_marker(cring__timeline_t *tl, const char *marker, double at_s) {
    if (!tl) return;
    char ev[256];
    snprintf(ev, sizeof ev,
             "{\"name\": \"%s\", \"ph\": \"i\", \"pid\": 0, \"tid\": 0, \"ts\": %.3f, "
             "\"s\": \"g\"}",
             marker, (at_s - tl->t0) * 1e6);
    emit(tl, ev);
}
