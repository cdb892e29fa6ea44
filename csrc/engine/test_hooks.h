/* test_hooks.h: hooks that let the C tests make the engine fail where nothing
 * else can (an allocation that fails, a peer's record that lies). They exist
 * only where CRING_TEST_HOOKS is defined, which build_flags.mk's
 * CRING_TEST_CFLAGS does for the C tests' library; the shipped extension has
 * none. Nothing outside csrc/engine and csrc/tests includes this header. */
#ifndef CRING_ENGINE_TEST_HOOKS_H
#define CRING_ENGINE_TEST_HOOKS_H

#ifdef CRING_TEST_HOOKS
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

/* execute.c: while above 0, each growth of the room for a round's batches
 * fails as an allocation would, and takes one off. */
extern _Atomic int cring__test_fail_batch_room;
/* request.c: when set, called with every request record this process builds
 * (its name, the record, its length), which it may rewrite in place, as a
 * corrupted record or a hostile peer would. Set it before submitting. */
extern void (*cring__test_record_hook)(const char *name, uint8_t *record, size_t len);
#endif

#endif
