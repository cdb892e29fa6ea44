/* common.c: status strings, clock, logging and error-message helpers shared by
 * all layers. Holds no communicator state. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "common.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

const char *cring_status_string(cring_status_t status) {
    switch (status) {
#define CRING__STATUS_MSG(name, value, msg)                                                        \
    case CRING_##name: return msg;
        CRING_STATUS_MAP(CRING__STATUS_MSG)
#undef CRING__STATUS_MSG
    }
    return "unknown status";
}

const char *cring_status_name(cring_status_t status) {
    switch (status) {
#define CRING__STATUS_NAME(name, value, msg)                                                       \
    case CRING_##name: return "CRING_" #name;
        CRING_STATUS_MAP(CRING__STATUS_NAME)
#undef CRING__STATUS_NAME
    }
    return "CRING_UNKNOWN";
}

static const struct {
    const char *name;
    size_t size;
} dtype_table[CRING_DTYPE_COUNT] = {
    [CRING_FLOAT16] = {"float16", 2}, [CRING_BFLOAT16] = {"bfloat16", 2},
    [CRING_FLOAT32] = {"float32", 4}, [CRING_FLOAT64] = {"float64", 8},
    [CRING_INT8] = {"int8", 1},       [CRING_UINT8] = {"uint8", 1},
    [CRING_INT32] = {"int32", 4},     [CRING_INT64] = {"int64", 8},
    [CRING_BOOL] = {"bool", 1},       [CRING_INT16] = {"int16", 2},
    [CRING_UINT16] = {"uint16", 2},   [CRING_UINT32] = {"uint32", 4},
    [CRING_UINT64] = {"uint64", 8},
};

size_t cring_dtype_size(cring_dtype_t dtype) {
    if ((int)dtype < 0 || dtype >= CRING_DTYPE_COUNT) return 0;
    return dtype_table[dtype].size;
}

const char *cring_dtype_name(cring_dtype_t dtype) {
    if ((int)dtype < 0 || dtype >= CRING_DTYPE_COUNT) return "invalid";
    return dtype_table[dtype].name;
}

const char *cring_op_name(cring_op_t op) {
    static const char *const names[CRING_OP_COUNT] = {
        [CRING_AVERAGE] = "average", [CRING_SUM] = "sum", [CRING_ADASUM] = "adasum",
        [CRING_MIN] = "min",         [CRING_MAX] = "max", [CRING_PRODUCT] = "product",
    };
    if ((int)op < 0 || op >= CRING_OP_COUNT) return "invalid";
    return names[op];
}

double cring__now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

double cring__now_coarse_s(void) {
    struct timespec ts;
#ifdef CLOCK_MONOTONIC_COARSE
    clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
#else
    clock_gettime(CLOCK_MONOTONIC, &ts);
#endif
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int log_level(void) {
    static int level = -1; /* benign race: every thread computes the same value */
    if (level < 0) {
        const char *v = getenv("CRING_LOG_LEVEL");
        int l = CRING__LOG_WARNING;
        if (v) {
            if (!strcasecmp(v, "error")) l = CRING__LOG_ERROR;
            else if (!strcasecmp(v, "warning") || !strcasecmp(v, "warn")) l = CRING__LOG_WARNING;
            else if (!strcasecmp(v, "info")) l = CRING__LOG_INFO;
            else if (!strcasecmp(v, "debug") || !strcasecmp(v, "trace")) l = CRING__LOG_DEBUG;
        }
        level = l;
    }
    return level;
}

int cring__log_enabled(int level) { return level <= log_level(); }

void cring__log(int level, int rank, const char *fmt, ...) {
    static const char *const names[] = {"error", "warning", "info", "debug"};
    if (!cring__log_enabled(level)) return;
    char line[1200];
    int n = rank >= 0 ? snprintf(line, sizeof line, "[cring rank %d] %s: ", rank, names[level])
                      : snprintf(line, sizeof line, "[cring] %s: ", names[level]);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line + n, sizeof line - (size_t)n, fmt, ap);
    va_end(ap);
    fprintf(stderr, "%s\n", line); /* one call: lines from threads do not interleave */
}

cring_status_t cring__fail(cring__errmsg_t *msg, cring_status_t st, const char *fmt, ...) {
    if (msg) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(msg->text, sizeof msg->text, fmt, ap);
        va_end(ap);
    }
    return st;
}

cring__errmsg_t *cring__thread_errmsg(void) {
    static _Thread_local cring__errmsg_t msg;
    return &msg;
}

double cring__env_double(const char *name, double dflt) {
    const char *v = getenv(name);
    if (!v || !*v) return dflt;
    char *end;
    double d = strtod(v, &end);
    return (end == v) ? dflt : d;
}

long cring__env_long(const char *name, long dflt) {
    const char *v = getenv(name);
    if (!v || !*v) return dflt;
    char *end;
    long l = strtol(v, &end, 10);
    return (end == v) ? dflt : l;
}
