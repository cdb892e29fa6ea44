/* timeline.h: a Chrome-trace (chrome://tracing, Perfetto) writer for the
 * engine, laid out as Horovod's timeline (one row per tensor). The file is replaced atomically by complete versions, so a reader
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
/* Tensor `name` is the input of collective `op` ("allreduce"): its row is
 * labelled "allreduce.<name>" (Horovod's naming) unless the name already
 * starts so. The first call for a name decides; a name never given here is
 * its own label. */
void cring__timeline_tensor(cring__timeline_t *tl, const char *name, const char *op);
/* A complete event: tensor `name` spent [start_s, end_s) (cring__now_s clock)
 * in `phase` (NEGOTIATE_ALLREDUCE, ALLREDUCE, QUEUE, MEMCPY_IN_FUSION_BUFFER,
 * CPU_ALLREDUCE, ...). `args` is NULL or a JSON object body such as
 * "\"bytes\": 4096". */
void cring__timeline_span(cring__timeline_t *tl, const char *name, const char *phase,
                          double start_s, double end_s, const char *args);

/* A global instant event (CYCLE_START) at at_s. */
void cring__timeline_marker(cring__timeline_t *tl, const char *marker, double at_s);

#endif
