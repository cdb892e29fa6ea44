/* common.h: helpers every layer of the C core may use: status-check macros,
 * clocks, logging, error-message formatting. No transport or Python knowledge. */
#ifndef CRING_COMMON_H
#define CRING_COMMON_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include "cring/cring.h"

/* Return the status of call if it is not CRING_OK. */
#define CRING_CHECK(call)                                                                          \
    do {                                                                                           \
        cring_status_t cring__st_ = (call);                                                        \
        if (cring__st_ != CRING_OK) return cring__st_;                                             \
    } while (0)

/* Store the status of call in st and jump to label if it is not CRING_OK. */
#define CRING_CHECK_GOTO(call, st, label)                                                          \
    do {                                                                                           \
        (st) = (call);                                                                             \
        if ((st) != CRING_OK) goto label;                                                          \
    } while (0)

#define CRING_MIN(a, b) ((a) < (b) ? (a) : (b))
#define CRING_MAX(a, b) ((a) > (b) ? (a) : (b))
#define CRING_CACHE_LINE 64

/* Monotonic clock in seconds. */
double cring__now_s(void);
/* The same clock at scheduler-tick resolution (a few ms), much cheaper to
 * read: for time-outs and stall checks, not for measurements. */
double cring__now_coarse_s(void);

/* Log levels: CRING_LOG_LEVEL=error|warning|info|debug (default warning). */
enum { CRING__LOG_ERROR = 0, CRING__LOG_WARNING = 1, CRING__LOG_INFO = 2, CRING__LOG_DEBUG = 3 };
/* Print "[cring rank R] level: message" to stderr when level is enabled.
 * Thread-safe. rank < 0 omits the rank. */
void cring__log(int level, int rank, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
int cring__log_enabled(int level);

/* A fixed-size message buffer for the "last error" of an object. */
#define CRING__ERRMSG_BYTES 1024
typedef struct cring__errmsg {
    char text[CRING__ERRMSG_BYTES];
} cring__errmsg_t;

/* Format into msg (truncating) and return st, so callers can write
 * `return cring__fail(&c->err, CRING_ERR_TIMEOUT, "...", ...)`. msg may be NULL. */
cring_status_t cring__fail(cring__errmsg_t *msg, cring_status_t st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Thread-local message for failures that happen before an object exists
 * (cring_comm_init, store connect). */
cring__errmsg_t *cring__thread_errmsg(void);

/* Read an environment variable as a double / int with a default when unset or
 * unparsable. */
double cring__env_double(const char *name, double dflt);
long cring__env_long(const char *name, long dflt);

#endif /* CRING_COMMON_H */
