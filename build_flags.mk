# The C build flags, one copy read by both builds: the Makefile includes this
# file (static library + C tests) and setup.py parses it (the extension
# cring._C). Keep to plain `NAME := words` lines: setup.py splits the words
# and knows no Make syntax beyond that.

# Every build: the language, the feature macros, threads.
CRING_CFLAGS := -std=c11 -D_GNU_SOURCE -pthread -fPIC
# Warnings: the same set everywhere.
CRING_WARNINGS := -Wall -Wextra -Wno-unused-parameter
# Include directories (-I), relative to the repository root.
CRING_INCLUDE_DIRS := csrc/include csrc
# Libraries linked (-l); -pthread is linked as well.
CRING_LIBS := rt m dl
# The layers of the core library (csrc/<layer>/*.c); setup.py adds pyext.
CRING_LAYERS := common bootstrap transport reduce algo core engine gpu

# Optimisation differs on purpose: the shipped extension is built -O3 and
# exports only its module init (hidden visibility); the C tests are built -O2
# -g so that a failing test can be debugged (make CFLAGS=... overrides it), with
# the engine's test hooks (csrc/engine/test_hooks.h), which the shipped
# extension never has.
# Vector kernels are chosen at run time by CPU feature: never -march here.
CRING_SHIPPED_CFLAGS := -O3 -fvisibility=hidden
CRING_TEST_CFLAGS := -O2 -g -DCRING_TEST_HOOKS
