# Builds the C core as a static library and its C tests, without Python.
#   make            -> build/libcring.a and build/tests/*
#   make test       -> run every C test
#   make SANITIZE=1 -> the same with ASan + UBSan (build-asan/)
CC ?= cc
SANITIZE ?= 0
BUILD := $(if $(filter 1,$(SANITIZE)),build-asan,build)
CFLAGS ?= -O2 -g
CFLAGS += -std=c11 -D_GNU_SOURCE -Wall -Wextra -Wno-unused-parameter -fPIC -pthread \
          -Icsrc/include -Icsrc
ifeq ($(SANITIZE),1)
CFLAGS += -fsanitize=address,undefined -fno-omit-frame-pointer
LDFLAGS += -fsanitize=address,undefined
endif
LDLIBS += -pthread -lrt -lm

LIB_SRCS := $(sort $(wildcard csrc/common/*.c csrc/bootstrap/*.c csrc/transport/*.c \
                              csrc/reduce/*.c csrc/algo/*.c csrc/core/*.c csrc/engine/*.c))
LIB_OBJS := $(patsubst csrc/%.c,$(BUILD)/obj/%.o,$(LIB_SRCS))
TEST_SRCS := $(sort $(wildcard csrc/tests/test_*.c))
TEST_BINS := $(patsubst csrc/tests/%.c,$(BUILD)/tests/%,$(TEST_SRCS))
HEADERS := $(wildcard csrc/include/cring/*.h csrc/*/*.h)

all: $(BUILD)/libcring.a $(TEST_BINS)

$(BUILD)/obj/%.o: csrc/%.c $(HEADERS)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -c $< -o $@

$(BUILD)/libcring.a: $(LIB_OBJS)
	@mkdir -p $(dir $@)
	rm -f $@ && ar rcs $@ $^

$(BUILD)/tests/%: csrc/tests/%.c csrc/tests/testutil.h $(BUILD)/libcring.a
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $< -o $@ $(BUILD)/libcring.a $(LDFLAGS) $(LDLIBS)

test: all
	@set -e; for t in $(TEST_BINS); do echo "== $$t"; timeout 300 $$t; done; \
	echo "C tests: $(words $(TEST_BINS)) programs passed"

clean:
	rm -rf build build-asan

.PHONY: all test clean
