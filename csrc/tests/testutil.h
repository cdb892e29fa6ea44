/* testutil.h: a tiny assertion kit for the C tests (no framework needed).
 * CHECK prints the failing expression with file:line and exits the test. */
#ifndef CRING_TESTUTIL_H
#define CRING_TESTUTIL_H

#include <stdio.h>
#include <stdlib.h>

static int testutil_checks = 0;

#define CHECK(cond)                                                                      \
    do {                                                                                 \
        testutil_checks++;                                                               \
        if (!(cond)) {                                                                   \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond);     \
            exit(1);                                                                     \
        }                                                                                \
    } while (0)

#define CHECK_OK(call)                                                                   \
    do {                                                                                 \
        cring_status_t st_ = (call);                                                     \
        testutil_checks++;                                                               \
        if (st_ != CRING_OK) {                                                           \
            fprintf(stderr, "%s:%d: %s returned %s (%s)\n", __FILE__, __LINE__, #call,   \
                    cring_status_name(st_), cring_status_string(st_));                   \
            exit(1);                                                                     \
        }                                                                                \
    } while (0)

#define TEST_DONE(name) printf("%s: %d checks passed\n", (name), testutil_checks)

#endif
