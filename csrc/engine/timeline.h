/* timeline.h: a Chrome-trace (chrome://tracing, Perfetto) writer for the
 * engine. The file is replaced atomically by complete versions, so a reader
 * always finds valid JSON; cring__timeline_flush makes it current (the
 * engine flushes before completing handles). Callers serialise access. */
#ifndef CRING_TIMELINE_H
#define CRING_TIMELINE_H

#include "../common/common.h"

typedef struct cring__timeline cring__timeline_t;

/* Create or truncate path. ERR_SYSTEM when it cannot be opened. */
cring_status_t cring__timeline_open(const char *path, int rank, cring__timeline_t **out);
void cring__timeline_close(cring__timeline_t *tl);
/* Make the file on disk hold every event recorded so far. */
void cring__timeline_flush(cring__timeline_t *tl);
/* A complete event: tensor `name` spent [start_s, end_s) (cring__now_s clock)
 * in `phase` (NEGOTIATE, QUEUE, MEMCPY_IN_FUSION_BUFFER, ALLREDUCE, ...).
 * `args` is NULL or a JSON object body such as "\"bytes\": 4096". */
void cring__timeline_span(cring__timeline_t *tl, const char *name, const char *phase,
                          double start_s, double end_s, const char *args);

#endif
