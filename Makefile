# Builds the C core as a static library and its C tests, without Python.
#   make            -> build/libcring.a and build/tests/*
#   make test       -> run every C test
#   make SANITIZE=1 -> the same with ASan + UBSan (build-asan/)
# The GPU layer (csrc/gpu) loads CUDA and NCCL with dlopen at run time: nothing
# here needs CUDA. Its tests use the test doubles libfake_nccl.so and
# libfake_cudart.so, built next to the test programs.
# The flags are in build_flags.mk, shared with setup.py.
include build_flags.mk
CC ?= cc
SANITIZE ?= 0
BUILD := $(if $(filter 1,$(SANITIZE)),build-asan,build)
CFLAGS ?= $(CRING_TEST_CFLAGS)
CFLAGS += $(CRING_CFLAGS) $(CRING_WARNINGS) $(addprefix -I,$(CRING_INCLUDE_DIRS))
ifeq ($(SANITIZE),1)
CFLAGS += -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer
LDFLAGS += -fsanitize=address,undefined
endif
LDLIBS += -pthread $(addprefix -l,$(CRING_LIBS))

LIB_SRCS := $(sort $(foreach layer,$(CRING_LAYERS),$(wildcard csrc/$(layer)/*.c)))
LIB_OBJS := $(patsubst csrc/%.c,$(BUILD)/obj/%.o,$(LIB_SRCS))
TEST_SRCS := $(sort $(wildcard csrc/tests/test_*.c))
TEST_BINS := $(patsubst csrc/tests/%.c,$(BUILD)/tests/%,$(TEST_SRCS))
HEADERS := $(wildcard csrc/include/cring/*.h csrc/*/*.h)
FAKE_LIBS := $(BUILD)/tests/libfake_nccl.so $(BUILD)/tests/libfake_nccl_no_allgather.so \
             $(BUILD)/tests/libfake_cudart.so

all: $(BUILD)/libcring.a $(TEST_BINS) $(FAKE_LIBS)

$(BUILD)/obj/%.o: csrc/%.c $(HEADERS) build_flags.mk
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -c $< -o $@

$(BUILD)/libcring.a: $(LIB_OBJS)
	@mkdir -p $(dir $@)
	rm -f $@ && ar rcs $@ $^

$(BUILD)/tests/%: csrc/tests/%.c csrc/tests/testutil.h $(BUILD)/libcring.a
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $< -o $@ $(BUILD)/libcring.a $(LDFLAGS) $(LDLIBS)

# Test doubles for the GPU layer ("device memory" is host memory).
FAKE_NCCL_SRCS := csrc/tests/fake_nccl.c csrc/tests/fake_nccl_reduce.c csrc/tests/fake_nccl.h \
                  csrc/tests/fake_log.h
$(BUILD)/tests/libfake_nccl.so: $(FAKE_NCCL_SRCS)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -shared $(filter %.c,$^) -o $@ $(LDFLAGS) -pthread -lrt -lm -ldl

$(BUILD)/tests/libfake_nccl_no_allgather.so: $(FAKE_NCCL_SRCS)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -DFAKE_NCCL_WITHOUT_ALLGATHER -shared $(filter %.c,$^) -o $@ $(LDFLAGS) \
	    -pthread -lrt -lm -ldl

$(BUILD)/tests/libfake_cudart.so: csrc/tests/fake_cudart.c csrc/tests/fake_device.c \
                                   csrc/tests/fake_device.h csrc/tests/fake_log.h
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -shared $(filter %.c,$^) -o $@ $(LDFLAGS) -pthread

test: all
	@set -e; for t in $(TEST_BINS); do echo "== $$t"; timeout 300 $$t; done; \
	echo "C tests: $(words $(TEST_BINS)) programs passed"

# The shared-memory collectives' microbenchmarks (benchmarks/shm_bench.c,
# benchmarks/region_bench.c).
bench: $(BUILD)/bench/shm_bench $(BUILD)/bench/region_bench

$(BUILD)/bench/shm_bench: benchmarks/shm_bench.c csrc/tests/testutil.h $(BUILD)/libcring.a
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $< -o $@ $(BUILD)/libcring.a $(LDFLAGS) $(LDLIBS)

$(BUILD)/bench/region_bench: benchmarks/region_bench.c csrc/tests/testutil.h $(BUILD)/libcring.a
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $< -o $@ $(BUILD)/libcring.a $(LDFLAGS) $(LDLIBS)

clean:
	rm -rf build build-asan

.PHONY: all test bench clean
