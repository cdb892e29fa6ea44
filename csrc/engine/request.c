/* request.c: building requests (one allocation each), checking a submission's
 * arguments, and the request record every rank sends to describe a request
 * (build, parse, compare, describe). Pure data: no locks, no communication,
 * no engine state beyond the spare request it reuses. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../common/wire.h"
#include "../reduce/reduce.h"
#include "engine_internal.h"
#include "test_hooks.h"

#ifdef CRING_TEST_HOOKS
void (*cring__test_record_hook)(const char *name, uint8_t *record, size_t len);
#endif

/* A request that never ran gives back what its backend's prepare attached. */
static void drop_ready_event(req_t *r) {
    if (r->ready_event && r->device.type == CRING_DEVICE_CUDA && cring__backend_cuda.discard)
        cring__backend_cuda.discard(r);
}

/* A request and everything it owns (tensor specs, shapes, name, record) is
 * one allocation. */
void cring__req_free(req_t *r) {
    if (r) {
        drop_ready_event(r);
        free(r->ghost);
    }
    free(r);
}

/* ---- request records ----------------------------------------------------------------
 * u16 name_len, name, u8 collective, u8 op, u8 compression, i32 root,
 * u8 device type, u16 device id, u16 ntensors, f64 prescale, f64 postscale
 * (their IEEE bits), then per tensor: u8 dtype, u8 ndim, i64 shape[ndim]
 * (little-endian). Everything every rank must agree on, except an allgather's
 * first dimensions and the device id (each rank has its own GPU); the id is
 * there for messages. The scale factors are there because they pick how a
 * batch runs (a CUDA integer allreduce with a factor is staged through host
 * memory), so ranks that disagree get a MismatchError instead of running
 * different collectives, and a joined rank's stand-in takes the same route. */

static uint64_t double_bits(double v) {
    uint64_t u;
    memcpy(&u, &v, sizeof u);
    return u;
}

static double bits_double(uint64_t u) {
    double v;
    memcpy(&v, &u, sizeof v);
    return v;
}

static size_t record_bytes(const cring_request_t *q) {
    size_t len = CRING__RECORD_FIXED_BYTES + strlen(q->name);
    for (int i = 0; i < q->ntensors; i++) len += 2 + 8 * (size_t)q->tensors[i].ndim;
    return len;
}

/* Write r's record into r->record (sized by record_bytes). */
static void build_record(req_t *r) {
    size_t name_len = strlen(r->name);
    uint8_t *p = r->record;
    cring__wire_put(&p, name_len, 2);
    memcpy(p, r->name, name_len);
    p += name_len;
    cring__wire_put(&p, (uint64_t)r->coll, 1);
    cring__wire_put(&p, (uint64_t)r->op, 1);
    cring__wire_put(&p, (uint64_t)r->compression, 1);
    cring__wire_put(&p, (uint64_t)(uint32_t)r->root, 4);
    cring__wire_put(&p, (uint64_t)r->device.type, 1);
    cring__wire_put(&p, (uint64_t)(uint16_t)r->device.id, 2);
    cring__wire_put(&p, (uint64_t)r->ntensors, 2);
    cring__wire_put(&p, double_bits(r->prescale), 8);
    cring__wire_put(&p, double_bits(r->postscale), 8);
    for (int i = 0; i < r->ntensors; i++) {
        cring__wire_put(&p, (uint64_t)r->t[i].dtype, 1);
        cring__wire_put(&p, (uint64_t)r->t[i].ndim, 1);
        for (int d = 0; d < r->t[i].ndim; d++) cring__wire_put(&p, (uint64_t)r->t[i].shape[d], 8);
    }
    r->record_len = (size_t)(p - r->record);
}

/* Parse and bounds-check a record (records come from other processes). */
int cring__record_parse(const uint8_t *rec, size_t len, parsed_t *out) {
    if (len < 2) return -1;
    size_t name_len = cring__wire_get(rec, 2);
    if (len < CRING__RECORD_FIXED_BYTES + name_len) return -1;
    const uint8_t *p = rec + 2 + name_len;
    out->name = (const char *)rec + 2;
    out->name_len = name_len;
    out->coll = (int)p[0];
    out->op = (int)p[1];
    out->compression = (int)p[2];
    out->root = (int)(int32_t)cring__wire_get(p + 3, 4);
    out->device_type = (int)p[7];
    out->device_id = (int)cring__wire_get(p + 8, 2);
    out->ntensors = (int)cring__wire_get(p + 10, 2);
    out->prescale = bits_double(cring__wire_get(p + 12, 8));
    out->postscale = bits_double(cring__wire_get(p + 20, 8));
    out->tensors = p + 28;
    out->tensors_len = len - (size_t)(out->tensors - rec);
    size_t off = 0;
    for (int i = 0; i < out->ntensors; i++) {
        if (off + 2 > out->tensors_len) return -1;
        off += 2 + 8 * (size_t)out->tensors[off + 1];
    }
    return off == out->tensors_len ? 0 : -1;
}

/* Describe tensor i of a parsed record: "float32 [4, 3]". */
static void describe_tensor(const parsed_t *p, int i, char *out, size_t n) {
    size_t off = 0;
    for (int k = 0; k < i; k++) off += 2 + 8 * (size_t)p->tensors[off + 1];
    int ndim = p->tensors[off + 1];
    int w = snprintf(out, n, "%s [", cring_dtype_name((cring_dtype_t)p->tensors[off]));
    for (int d = 0; d < ndim && w > 0 && (size_t)w < n; d++)
        w += snprintf(out + w, n - (size_t)w, "%s%lld", d ? ", " : "",
                      (long long)(int64_t)cring__wire_get(p->tensors + off + 2 + 8 * (size_t)d, 8));
    if (w > 0 && (size_t)w < n) snprintf(out + w, n - (size_t)w, "]");
}

void cring__device_describe(int type, int id, char *out, size_t n) {
    if (type == CRING_DEVICE_CPU) snprintf(out, n, "cpu");
    else if (type == CRING_DEVICE_CUDA) snprintf(out, n, "cuda:%d", id);
    else snprintf(out, n, "device type %d", type);
}

int cring__record_difference(const parsed_t *a, int ra, const parsed_t *b, int rb, char *out,
                             size_t n) {
    if (a->device_type != b->device_type) {
        char da[32], db[32];
        cring__device_describe(a->device_type, a->device_id, da, sizeof da);
        cring__device_describe(b->device_type, b->device_id, db, sizeof db);
        return snprintf(out, n, "device: rank %d: %s tensor, rank %d: %s tensor", rb, db, ra, da);
    }
    if (a->coll != b->coll)
        return snprintf(out, n, "collective %s vs %s", cring_collective_name(a->coll),
                        cring_collective_name(b->coll));
    if (a->ntensors != b->ntensors)
        return snprintf(out, n, "a group of %d tensors vs %d", a->ntensors, b->ntensors);
    if (a->op != b->op)
        return snprintf(out, n, "op %s vs %s", cring_op_name(a->op), cring_op_name(b->op));
    if (a->root != b->root) return snprintf(out, n, "root rank %d vs %d", a->root, b->root);
    if (a->compression != b->compression) return snprintf(out, n, "compression differs");
    if (a->prescale != b->prescale || a->postscale != b->postscale)
        return snprintf(out, n,
                        "scale factors: prescale %g, postscale %g vs prescale %g, postscale %g",
                        a->prescale, a->postscale, b->prescale, b->postscale);
    size_t oa = 0, ob = 0;
    for (int i = 0; i < a->ntensors; i++) {
        int nda = a->tensors[oa + 1], ndb = b->tensors[ob + 1];
        int same = a->tensors[oa] == b->tensors[ob] && nda == ndb;
        for (int d = 0; same && d < nda; d++) {
            if (d == 0 && (a->coll == CRING_COLL_ALLGATHER || a->coll == CRING_COLL_ALLTOALL))
                continue;
            same = cring__wire_get(a->tensors + oa + 2 + 8 * (size_t)d, 8) ==
                   cring__wire_get(b->tensors + ob + 2 + 8 * (size_t)d, 8);
        }
        if (!same) {
            char da[160], db[160];
            describe_tensor(a, i, da, sizeof da);
            describe_tensor(b, i, db, sizeof db);
            const char *what = a->tensors[oa] != b->tensors[ob] ? "dtype" : "shape";
            if (a->ntensors > 1)
                return snprintf(out, n, "%s of tensor %d: %s vs %s", what, i, da, db);
            return snprintf(out, n, "%s %s vs %s", what, da, db);
        }
        oa += 2 + 8 * (size_t)nda;
        ob += 2 + 8 * (size_t)ndb;
    }
    return 0;
}

/* First dimension of every tensor of a parsed record into dims[i*size + r]. */
void cring__record_first_dims(const parsed_t *p, int r, int size, int64_t *dims) {
    size_t off = 0;
    for (int i = 0; i < p->ntensors; i++) {
        int ndim = p->tensors[off + 1];
        dims[(size_t)i * (size_t)size + (size_t)r] =
            ndim ? (int64_t)cring__wire_get(p->tensors + off + 2, 8) : 1;
        off += 2 + 8 * (size_t)ndim;
    }
}

/* ---- submission -------------------------------------------------------------------------- */

/* Adasum (core/adasum.c): allreduce only, CPU tensors of a floating dtype,
 * a power-of-two number of ranks. Every rank makes the same checks, so each
 * one raises the same error. */
static cring_status_t validate_adasum(cring_engine_t *e, const cring_request_t *q) {
    if (q->collective != CRING_COLL_ALLREDUCE)
        return cring__engine_submit_fail(CRING_ERR_INVALID_ARGUMENT,
                                         "'%s': Adasum applies to allreduce only, not %s", q->name,
                                         cring_collective_name(q->collective));
    if (!cring__adasum_size_ok(e->size))
        return cring__engine_submit_fail(
            CRING_ERR_INVALID_ARGUMENT,
            "'%s': Adasum needs a power-of-two number of ranks; this job has %d", q->name, e->size);
    if (q->device.type != CRING_DEVICE_CPU)
        return cring__engine_submit_fail(
            CRING_ERR_INVALID_ARGUMENT,
            "'%s': Adasum runs on CPU tensors only; move the tensor to the CPU or use Average",
            q->name);
    for (int i = 0; i < q->ntensors; i++) {
        cring_dtype_t d = q->tensors[i].dtype;
        if (!cring__adasum_supported(d))
            return cring__engine_submit_fail(CRING_ERR_NOT_SUPPORTED,
                                             "'%s': Adasum reduces float16, bfloat16, float32 and "
                                             "float64 tensors, not %s",
                                             q->name, cring_dtype_name(d));
    }
    return CRING_OK;
}

cring_status_t cring__req_validate(cring_engine_t *e, const cring_request_t *q) {
    if (!q->name || !*q->name)
        return cring__engine_submit_fail(CRING_ERR_INVALID_ARGUMENT, "a request needs a name");
    if (strlen(q->name) > CRING__MAX_NAME_BYTES)
        return cring__engine_submit_fail(CRING_ERR_INVALID_ARGUMENT,
                                         "name of %zu bytes is too long (max %d)", strlen(q->name),
                                         CRING__MAX_NAME_BYTES);
    if (q->collective < CRING_COLL_ALLREDUCE || q->collective > CRING_COLL_JOIN)
        return cring__engine_submit_fail(CRING_ERR_INVALID_ARGUMENT, "unknown collective %d",
                                         (int)q->collective);
    if (q->ntensors < 0 || q->ntensors > 65535 || (q->ntensors && !q->tensors))
        return cring__engine_submit_fail(CRING_ERR_INVALID_ARGUMENT, "'%s': bad tensor list",
                                         q->name);
    if (q->device.type != CRING_DEVICE_CPU && q->device.type != CRING_DEVICE_CUDA)
        return cring__engine_submit_fail(CRING_ERR_INVALID_ARGUMENT, "'%s': unknown device type %d",
                                         q->name, (int)q->device.type);
    if (q->device.id < 0 || q->device.id > 65535)
        return cring__engine_submit_fail(CRING_ERR_INVALID_ARGUMENT, "'%s': bad device id %d",
                                         q->name, q->device.id);
    int bare = q->collective == CRING_COLL_BARRIER || q->collective == CRING_COLL_JOIN;
    if (bare && q->ntensors)
        return cring__engine_submit_fail(CRING_ERR_INVALID_ARGUMENT, "a %s carries no tensors",
                                         cring_collective_name(q->collective));
    if (!bare && !q->ntensors)
        return cring__engine_submit_fail(CRING_ERR_INVALID_ARGUMENT, "'%s': no tensors", q->name);
    if (q->collective == CRING_COLL_ALLTOALL) {
        if (q->ntensors != 1)
            return cring__engine_submit_fail(CRING_ERR_INVALID_ARGUMENT,
                                             "'%s': alltoall takes one tensor", q->name);
        const cring_tensor_t *t = &q->tensors[0];
        if (t->ndim < 1 || !t->shape)
            return cring__engine_submit_fail(
                CRING_ERR_INVALID_ARGUMENT,
                "'%s': alltoall needs a tensor with at least one dimension", q->name);
        if (q->splits) {
            int64_t sum = 0;
            for (int r = 0; r < e->size; r++) {
                if (q->splits[r] < 0)
                    return cring__engine_submit_fail(
                        CRING_ERR_INVALID_ARGUMENT,
                        "'%s': alltoall split %d for rank %d is negative", q->name,
                        (int)q->splits[r], r);
                sum += q->splits[r];
            }
            if (sum != t->shape[0])
                return cring__engine_submit_fail(
                    CRING_ERR_INVALID_ARGUMENT,
                    "'%s': alltoall splits add up to %lld rows but the tensor's "
                    "first dimension is %lld",
                    q->name, (long long)sum, (long long)t->shape[0]);
        } else if (t->shape[0] % e->size) {
            return cring__engine_submit_fail(
                CRING_ERR_INVALID_ARGUMENT,
                "'%s': alltoall without splits divides the first dimension (%lld) "
                "evenly among %d ranks; it does not divide: pass splits",
                q->name, (long long)t->shape[0], e->size);
        }
    }
    if (q->collective == CRING_COLL_BROADCAST && (q->root < 0 || q->root >= e->size))
        return cring__engine_submit_fail(CRING_ERR_INVALID_ARGUMENT,
                                         "'%s': root rank %d is out of range for size %d", q->name,
                                         q->root, e->size);
    int reduces =
        q->collective == CRING_COLL_ALLREDUCE || q->collective == CRING_COLL_REDUCESCATTER;
    int has_compression = q->compression != CRING_DTYPE_COUNT;
    if (has_compression && q->compression != CRING_FLOAT16 && q->compression != CRING_BFLOAT16)
        return cring__engine_submit_fail(CRING_ERR_INVALID_ARGUMENT,
                                         "'%s': compression must be float16 or bfloat16", q->name);
    if (has_compression && q->collective != CRING_COLL_ALLREDUCE)
        return cring__engine_submit_fail(CRING_ERR_INVALID_ARGUMENT,
                                         "'%s': compression applies to allreduce only", q->name);
    if (reduces && q->op == CRING_ADASUM) CRING_CHECK(validate_adasum(e, q));
    for (int i = 0; i < q->ntensors; i++) {
        const cring_tensor_t *t = &q->tensors[i];
        if (!cring_dtype_size(t->dtype))
            return cring__engine_submit_fail(CRING_ERR_INVALID_ARGUMENT, "'%s': invalid dtype",
                                             q->name);
        if (t->ndim < 0 || t->ndim > 32 || (t->ndim && !t->shape))
            return cring__engine_submit_fail(CRING_ERR_INVALID_ARGUMENT, "'%s': bad shape",
                                             q->name);
        for (int d = 0; d < t->ndim; d++)
            if (t->shape[d] < 0)
                return cring__engine_submit_fail(CRING_ERR_INVALID_ARGUMENT,
                                                 "'%s': negative dimension", q->name);
        if (reduces && q->op != CRING_ADASUM && !cring__reduce_supported(t->dtype, q->op))
            return cring__engine_submit_fail(CRING_ERR_NOT_SUPPORTED,
                                             "'%s': op %s cannot reduce %s", q->name,
                                             cring_op_name(q->op), cring_dtype_name(t->dtype));
        if (has_compression && t->dtype != CRING_FLOAT32)
            return cring__engine_submit_fail(CRING_ERR_INVALID_ARGUMENT,
                                             "'%s': compression applies to float32 tensors, not %s",
                                             q->name, cring_dtype_name(t->dtype));
        if (q->collective == CRING_COLL_REDUCESCATTER && t->ndim == 0)
            return cring__engine_submit_fail(CRING_ERR_INVALID_ARGUMENT,
                                             "'%s': reducescatter needs at least one dimension",
                                             q->name);
    }
    return CRING_OK;
}

/* Requests up to this size are kept in the engine's pool for reuse. */
#define POOL_REQ_MAX_BYTES 1024

/* Free a request that has run, keeping it as the engine's spare if it is
 * the biggest seen lately (a loop of synchronous calls then allocates
 * none), else in the engine's pool when small (a burst of asynchronous
 * ones neither). */
void cring__req_recycle(cring_engine_t *e, req_t *r) {
    if (!r || r->ghost) {
        cring__req_free(r);
        return;
    }
    drop_ready_event(r);
    req_t *old = atomic_exchange(&e->spare.req, r);
    if (old && old->alloc_bytes > r->alloc_bytes) old = atomic_exchange(&e->spare.req, old);
    if (old && (old->alloc_bytes > POOL_REQ_MAX_BYTES || !cring__pool_give(&e->spare.reqs, old)))
        free(old);
}

req_t *cring__req_make(cring_engine_t *e, const cring_request_t *q, int size) {
    size_t ndims = 0, name_len = strlen(q->name);
    for (int i = 0; i < q->ntensors; i++) ndims += (size_t)q->tensors[i].ndim;
    size_t nsplits = q->collective == CRING_COLL_ALLTOALL ? (size_t)size : 0;
    ndims += nsplits;
    size_t bytes = sizeof(req_t) + sizeof(tensor_spec_t) * (size_t)q->ntensors +
                   sizeof(int64_t) * ndims + name_len + 1 + record_bytes(q);
    req_t *r = e ? atomic_exchange(&e->spare.req, NULL) : NULL;
    if (!r && e) r = cring__pool_take(&e->spare.reqs);
    if (r && r->alloc_bytes < bytes) {
        free(r);
        r = NULL;
    }
    size_t alloc_bytes = r ? r->alloc_bytes : bytes;
    if (!r) r = malloc(bytes);
    if (!r) return NULL;
    memset(r, 0, sizeof *r);
    r->alloc_bytes = alloc_bytes;
    r->t = (tensor_spec_t *)(r + 1);
    int64_t *dims = (int64_t *)(r->t + q->ntensors);
    r->name = (char *)(dims + ndims);
    r->record = (uint8_t *)r->name + name_len + 1;
    memcpy(r->name, q->name, name_len + 1);
    r->name_hash = cring__strmap_hash(r->name);
    r->coll = q->collective;
    r->op = q->op;
    r->root = q->root;
    r->prescale = q->prescale == 0 ? 1.0 : q->prescale;
    r->postscale = q->postscale == 0 ? 1.0 : q->postscale;
    r->compression = q->compression;
    r->ntensors = q->ntensors;
    r->device = q->device;
    r->sequenced = (q->flags & CRING_REQUEST_SEQUENCED) != 0;
    r->cache_id = -1;
    if (nsplits) {
        r->splits = dims;
        dims += nsplits;
        for (size_t k = 0; k < nsplits; k++)
            r->splits[k] = q->splits ? q->splits[k] : q->tensors[0].shape[0] / size;
    }
    for (int i = 0; i < q->ntensors; i++) {
        const cring_tensor_t *in = &q->tensors[i];
        tensor_spec_t *t = &r->t[i];
        t->send = in->send;
        t->recv = in->recv;
        t->dtype = in->dtype;
        t->ndim = in->ndim;
        t->shape = dims;
        dims += in->ndim;
        t->count = 1;
        t->row_elems = 1;
        for (int d = 0; d < in->ndim; d++) {
            t->shape[d] = in->shape[d];
            t->count *= (size_t)in->shape[d];
            if (d > 0) t->row_elems *= (size_t)in->shape[d];
        }
        t->bytes = t->count * cring_dtype_size(t->dtype);
    }
    build_record(r);
#ifdef CRING_TEST_HOOKS
    if (cring__test_record_hook) cring__test_record_hook(r->name, r->record, r->record_len);
#endif
    return r;
}
