/* engine_tools.h: engine entry points for C tools and benchmarks only (not
 * the public API, not the Python module): running plain communicator calls
 * between the engine's rounds. Must not grow anything a user needs. */
#ifndef CRING_ENGINE_TOOLS_H
#define CRING_ENGINE_TOOLS_H

#include "cring/cring.h"

/* Run fn(comm, arg) on the engine's communicator while no round is being
 * driven on this rank. For benchmarks and tools: every rank must call it at
 * the same point, with no request in flight anywhere, and fn must make the
 * same collective calls on every rank. Returns fn's status (ERR_CLOSED once
 * the engine stopped). */
CRING_API cring_status_t cring_engine_exclusive(cring_engine_t *engine,
                                                cring_status_t (*fn)(cring_comm_t *, void *),
                                                void *arg);

#endif
