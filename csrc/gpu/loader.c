/* loader.c: finds libcudart and libnccl at run time with dlopen and resolves
 * the functions cring calls into the tables of cuda_api.h. It must never make
 * the build or the import of cring depend on CUDA: a missing library is an
 * answer ("not available, because ..."), not an error at load time. */
#include <dlfcn.h>
#include <link.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gpu_internal.h"

typedef struct {
    const char *name;
    size_t offset; /* of the function pointer in the api table */
    int required;
} symbol_t;

#define CUDART_SYM(field, req)                                                                     \
    { "cuda" #field, offsetof(cring__cudart_api_t, field), req }
static const symbol_t cudart_symbols[] = {
    CUDART_SYM(GetDeviceCount, 1),
    CUDART_SYM(GetDevice, 1),
    CUDART_SYM(SetDevice, 1),
    CUDART_SYM(RuntimeGetVersion, 1),
    CUDART_SYM(GetErrorString, 1),
    CUDART_SYM(HostAlloc, 1),
    CUDART_SYM(FreeHost, 1),
    CUDART_SYM(MemcpyAsync, 1),
    CUDART_SYM(StreamSynchronize, 1),
    CUDART_SYM(Malloc, 1),
    CUDART_SYM(Free, 1),
    CUDART_SYM(MemsetAsync, 1),
    CUDART_SYM(EventCreateWithFlags, 1),
    CUDART_SYM(EventDestroy, 1),
    CUDART_SYM(EventRecord, 1),
    CUDART_SYM(EventQuery, 1),
    CUDART_SYM(EventSynchronize, 1),
    CUDART_SYM(StreamWaitEvent, 1),
    CUDART_SYM(StreamCreateWithFlags, 1),
    CUDART_SYM(MallocAsync, 0),
    CUDART_SYM(FreeAsync, 0),
};

#define NCCL_SYM(field, req)                                                                       \
    { "nccl" #field, offsetof(cring__nccl_api_t, field), req }
static const symbol_t nccl_symbols[] = {
    NCCL_SYM(GetVersion, 1),     NCCL_SYM(GetUniqueId, 1),
    NCCL_SYM(CommInitRank, 1),   NCCL_SYM(CommDestroy, 1),
    NCCL_SYM(CommAbort, 1),      NCCL_SYM(CommGetAsyncError, 1),
    NCCL_SYM(GetErrorString, 1), NCCL_SYM(GetLastError, 0),
    NCCL_SYM(AllReduce, 1),      NCCL_SYM(Broadcast, 1),
    NCCL_SYM(Reduce, 1),         NCCL_SYM(AllGather, 1),
    NCCL_SYM(ReduceScatter, 1),  NCCL_SYM(GroupStart, 1),
    NCCL_SYM(GroupEnd, 1),       NCCL_SYM(RedOpCreatePreMulSum, 1),
    NCCL_SYM(RedOpDestroy, 1),   NCCL_SYM(Send, 1),
    NCCL_SYM(Recv, 1),
};

typedef struct {
    const char *what;                /* "the CUDA runtime" / "NCCL" */
    const char *env;                 /* explicit path variable */
    const char *const *loaded_names; /* sonames to look for among loaded objects */
    const char *const *system_names; /* names for the dynamic linker's search */
    const symbol_t *symbols;
    size_t nsymbols;
    void *table; /* cring__cudart_api_t or cring__nccl_api_t */
    size_t table_bytes;
    /* Check a candidate after its symbols resolved: 0 ok, else fills why. */
    int (*validate)(void *table, int *version, char *why, size_t why_len);
} library_spec_t;

static int validate_cudart(void *table, int *version, char *why, size_t why_len) {
    cring__cudart_api_t *api = table;
    int v = 0;
    cudaError_t e = api->RuntimeGetVersion(&v);
    if (e != CRING_CUDA_SUCCESS) {
        snprintf(why, why_len, "cudaRuntimeGetVersion failed (%s)", api->GetErrorString(e));
        return -1;
    }
    *version = v;
    return 0;
}

static void nccl_version_string(int code, char *out, size_t len) {
    if (code >= 10000)
        snprintf(out, len, "%d.%d.%d", code / 10000, (code % 10000) / 100, code % 100);
    else snprintf(out, len, "%d.%d.%d", code / 1000, (code % 1000) / 100, code % 100);
}

static int validate_nccl(void *table, int *version, char *why, size_t why_len) {
    cring__nccl_api_t *api = table;
    int v = 0;
    ncclResult_t r = api->GetVersion(&v);
    if (r != ncclSuccess) {
        snprintf(why, why_len, "ncclGetVersion failed (%s)", api->GetErrorString(r));
        return -1;
    }
    if (v < CRING_NCCL_MIN_VERSION_CODE) {
        char have[32];
        nccl_version_string(v, have, sizeof have);
        snprintf(why, why_len, "NCCL %s is too old: cring needs 2.10.3 or newer", have);
        return -1;
    }
    *version = v;
    return 0;
}

/* Append "; item" to a bounded message. */
static void append(char *buf, size_t len, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void append(char *buf, size_t len, const char *fmt, ...) {
    size_t used = strlen(buf);
    if (used + 1 >= len) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf + used, len - used, fmt, ap);
    va_end(ap);
}

/* Resolve every symbol of spec from handle into a scratch table; on success
 * copy it into spec->table. Returns 0, or -1 with the reason in why. */
static int resolve(const library_spec_t *spec, void *handle, int *version, char *why,
                   size_t why_len) {
    unsigned char scratch[256];
    if (spec->table_bytes > sizeof scratch) {
        snprintf(why, why_len, "internal error: symbol table too large");
        return -1;
    }
    memset(scratch, 0, sizeof scratch);
    for (size_t i = 0; i < spec->nsymbols; i++) {
        dlerror();
        void *fn = dlsym(handle, spec->symbols[i].name);
        if (!fn && spec->symbols[i].required) {
            snprintf(why, why_len, "it has no %s (not a usable %s)", spec->symbols[i].name,
                     spec->what);
            return -1;
        }
        memcpy(scratch + spec->symbols[i].offset, &fn, sizeof fn);
    }
    if (spec->validate(scratch, version, why, why_len) != 0) return -1;
    memcpy(spec->table, scratch, spec->table_bytes);
    return 0;
}

static void loaded_path(void *handle, const char *fallback, char *out, size_t len) {
    struct link_map *lm = NULL;
    if (dlinfo(handle, RTLD_DI_LINKMAP, &lm) == 0 && lm && lm->l_name && lm->l_name[0])
        snprintf(out, len, "%s", lm->l_name);
    else snprintf(out, len, "%s", fallback);
}

/* Try one candidate. flags: RTLD_NOLOAD for "already loaded". Returns 1 and
 * fills lib on success; 0 after appending why it failed to tried. */
static int try_candidate(const library_spec_t *spec, cring__gpu_library_t *lib, const char *path,
                         int noload, char *tried, size_t tried_len) {
    dlerror();
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL | (noload ? RTLD_NOLOAD : 0));
    if (!h) {
        if (!noload) {
            const char *e = dlerror();
            append(tried, tried_len, "; %s: %s", path, e ? e : "cannot be loaded");
        }
        return 0;
    }
    char why[256] = "";
    int version = 0;
    if (resolve(spec, h, &version, why, sizeof why) != 0) {
        append(tried, tried_len, "; %s: %s", path, why);
        dlclose(h);
        return 0;
    }
    lib->handle = h;
    lib->version = version;
    loaded_path(h, path, lib->path, sizeof lib->path);
    return 1;
}

static cring_status_t search(const library_spec_t *spec, cring__gpu_library_t *lib,
                             const char *const *wheel_paths, size_t n) {
    char tried[CRING__ERRMSG_BYTES] = "";
    const char *explicit_path = getenv(spec->env);
    if (explicit_path && *explicit_path) {
        dlerror();
        void *h = dlopen(explicit_path, RTLD_NOW | RTLD_LOCAL);
        char why[512] = "";
        int version = 0;
        if (!h) {
            const char *e = dlerror();
            snprintf(why, sizeof why, "%s", e ? e : "cannot be loaded");
        } else if (resolve(spec, h, &version, why, sizeof why) != 0) {
            dlclose(h);
            h = NULL;
        }
        if (!h)
            return cring__fail(&lib->message, CRING_ERR_NOT_SUPPORTED, "%s=%s cannot be used: %s",
                               spec->env, explicit_path, why);
        lib->handle = h;
        lib->version = version;
        loaded_path(h, explicit_path, lib->path, sizeof lib->path);
        return CRING_OK;
    }
    for (const char *const *name = spec->loaded_names; *name; name++)
        if (try_candidate(spec, lib, *name, 1, tried, sizeof tried)) return CRING_OK;
    for (size_t i = 0; i < n; i++) {
        if (access(wheel_paths[i], F_OK) != 0) continue; /* not installed there */
        if (try_candidate(spec, lib, wheel_paths[i], 0, tried, sizeof tried)) return CRING_OK;
    }
    for (const char *const *name = spec->system_names; *name; name++)
        if (try_candidate(spec, lib, *name, 0, tried, sizeof tried)) return CRING_OK;
    return cring__fail(&lib->message, CRING_ERR_NOT_SUPPORTED,
                       "%s was not found (%s unset; no pip wheel on the import path; tried%s)",
                       spec->what, spec->env, tried[0] ? tried + 1 : " nothing");
}

static cring_status_t load(cring__gpu_t *g, const library_spec_t *spec, cring__gpu_library_t *lib,
                           const char *const *wheel_paths, size_t n, cring__errmsg_t *err) {
    pthread_mutex_lock(&g->mu);
    if (!lib->tried) {
        lib->status = search(spec, lib, wheel_paths, n);
        lib->tried = 1;
    }
    cring_status_t st = lib->status;
    if (st != CRING_OK && err) *err = lib->message;
    pthread_mutex_unlock(&g->mu);
    return st;
}

static const char *const cudart_loaded[] = {"libcudart.so.13", "libcudart.so.12",
                                            "libcudart.so.11.0", NULL};
static const char *const cudart_system[] = {"libcudart.so.13", "libcudart.so.12",
                                            "libcudart.so.11.0", "libcudart.so", NULL};
static const char *const nccl_loaded[] = {"libnccl.so.2", NULL};
static const char *const nccl_system[] = {"libnccl.so.2", "libnccl.so", NULL};

cring_status_t cring__gpu_load_cudart(cring__gpu_t *g, const char *const *wheel_paths, size_t n,
                                      cring__errmsg_t *err) {
    library_spec_t spec = {
        .what = "the CUDA runtime",
        .env = "CRING_CUDART_LIBRARY",
        .loaded_names = cudart_loaded,
        .system_names = cudart_system,
        .symbols = cudart_symbols,
        .nsymbols = sizeof cudart_symbols / sizeof *cudart_symbols,
        .table = &g->cudart,
        .table_bytes = sizeof g->cudart,
        .validate = validate_cudart,
    };
    return load(g, &spec, &g->cudart_lib, wheel_paths, n, err);
}

cring_status_t cring__gpu_load_nccl(cring__gpu_t *g, const char *const *wheel_paths, size_t n,
                                    cring__errmsg_t *err) {
    library_spec_t spec = {
        .what = "NCCL",
        .env = "CRING_NCCL_LIBRARY",
        .loaded_names = nccl_loaded,
        .system_names = nccl_system,
        .symbols = nccl_symbols,
        .nsymbols = sizeof nccl_symbols / sizeof *nccl_symbols,
        .table = &g->nccl,
        .table_bytes = sizeof g->nccl,
        .validate = validate_nccl,
    };
    return load(g, &spec, &g->nccl_lib, wheel_paths, n, err);
}

const char *cring__gpu_cudart_path(const cring__gpu_t *g) {
    return cring__gpu_has_cudart(g) ? g->cudart_lib.path : NULL;
}
int cring__gpu_cudart_version(const cring__gpu_t *g) {
    return cring__gpu_has_cudart(g) ? g->cudart_lib.version : 0;
}
const char *cring__gpu_nccl_path(const cring__gpu_t *g) {
    return cring__gpu_has_nccl(g) ? g->nccl_lib.path : NULL;
}
int cring__gpu_nccl_version(const cring__gpu_t *g) {
    return cring__gpu_has_nccl(g) ? g->nccl_lib.version : 0;
}
int cring__gpu_nccl_one_rank_defect(int version) {
    return version >= CRING_NCCL_ONE_RANK_DEFECT_FIRST &&
           version < CRING_NCCL_ONE_RANK_DEFECT_FIXED;
}

const char *cring__gpu_cuda_error(const cring__gpu_t *g, cudaError_t e) {
    const char *s = g->cudart.GetErrorString ? g->cudart.GetErrorString(e) : NULL;
    return s ? s : "unknown CUDA error";
}

int cring__gpu_device_count(cring__gpu_t *g, cring__errmsg_t *why) {
    if (!cring__gpu_has_cudart(g)) {
        if (why) cring__fail(why, CRING_ERR_NOT_SUPPORTED, "the CUDA runtime is not loaded");
        return 0;
    }
    int count = 0;
    cudaError_t e = g->cudart.GetDeviceCount(&count);
    if (e != CRING_CUDA_SUCCESS) {
        if (why)
            cring__fail(why, CRING_ERR_NOT_SUPPORTED, "cudaGetDeviceCount: %s (cuda error %d)",
                        cring__gpu_cuda_error(g, e), e);
        return 0;
    }
    if (count <= 0 && why) cring__fail(why, CRING_ERR_NOT_SUPPORTED, "no CUDA device is visible");
    return count > 0 ? count : 0;
}

cring_status_t cring__gpu_create(cring__gpu_t **out) {
    *out = NULL;
    cring__gpu_t *g = calloc(1, sizeof *g);
    if (!g) return CRING_ERR_NO_MEMORY;
    pthread_mutex_init(&g->mu, NULL);
    pthread_mutex_init(&g->lane_mu, NULL);
    long limit = cring__env_long("CRING_GPU_PINNED_CACHE_BYTES", 256L << 20);
    g->pinned_cache_limit = limit > 0 ? (size_t)limit : 0;
    *out = g;
    return CRING_OK;
}

static cring__gpu_t *global_context;
static pthread_once_t global_once = PTHREAD_ONCE_INIT;

static void global_create(void) {
    if (cring__gpu_create(&global_context) != CRING_OK) global_context = NULL;
}

cring__gpu_t *cring__gpu_global(void) {
    pthread_once(&global_once, global_create);
    return global_context;
}

void cring__gpu_get_stats(cring__gpu_t *g, cring__gpu_stats_t *out) {
    pthread_mutex_lock(&g->mu);
    *out = g->stats;
    pthread_mutex_unlock(&g->mu);
}
