/* store_protocol.c: encoding and decoding of the rendezvous store's messages
 * (layout in store_protocol.h), and the names of its opcodes and statuses.
 * Pure byte math over caller buffers: no I/O, no allocation. */
#include "store_protocol.h"

#include <math.h>
#include <string.h>

#include "../common/wire.h"

const char *cring__store_op_name(unsigned op) {
    switch (op) {
#define CRING__STORE_OP_CASE(name, code, text)                                                     \
    case code: return text;
        CRING__STORE_OPS(CRING__STORE_OP_CASE)
#undef CRING__STORE_OP_CASE
    default: return "unknown";
    }
}

const char *cring__store_reply_name(unsigned status) {
    switch (status) {
#define CRING__STORE_REPLY_CASE(name, code, text)                                                  \
    case code: return text;
        CRING__STORE_REPLIES(CRING__STORE_REPLY_CASE)
#undef CRING__STORE_REPLY_CASE
    default: return "unknown";
    }
}

size_t cring__store_put_u32(uint8_t *buf, uint32_t v) {
    cring__wire_put_u32(buf, v);
    return 4;
}

size_t cring__store_put_u64(uint8_t *buf, uint64_t v) {
    uint8_t *p = buf;
    cring__wire_put(&p, v, 8);
    return 8;
}

size_t cring__store_put_head(uint8_t *buf, uint8_t code, size_t payload_len) {
    cring__wire_put_u32(buf, (uint32_t)(1 + payload_len));
    buf[4] = code;
    return STORE_HEAD_BYTES;
}

size_t cring__store_put_key(uint8_t *buf, const char *key, size_t len) {
    cring__wire_put_u32(buf, (uint32_t)len);
    if (len) memcpy(buf + 4, key, len);
    return 4 + len;
}

uint32_t cring__store_head_length(const uint8_t *head) { return cring__wire_get_u32(head); }

int cring__store_length_ok(uint32_t len) { return len != 0 && len <= STORE_MAX_MESSAGE_BYTES; }

uint64_t cring__store_get_u64(const uint8_t *p) { return cring__wire_get(p, 8); }

const uint8_t *cring__store_take(cring__store_cursor_t *cur, size_t n) {
    if (cur->bad || cur->left < n) {
        cur->bad = 1;
        return NULL;
    }
    const uint8_t *r = cur->p;
    cur->p += n;
    cur->left -= n;
    return r;
}

uint64_t cring__store_take_u64(cring__store_cursor_t *cur) {
    const uint8_t *p = cring__store_take(cur, 8);
    return p ? cring__wire_get(p, 8) : 0;
}

uint32_t cring__store_take_u32(cring__store_cursor_t *cur) {
    const uint8_t *p = cring__store_take(cur, 4);
    return p ? cring__wire_get_u32(p) : 0;
}

const char *cring__store_take_key(cring__store_cursor_t *cur, size_t *len) {
    uint32_t n = cring__store_take_u32(cur);
    if (n > STORE_MAX_KEY_BYTES) cur->bad = 1;
    const uint8_t *k = cring__store_take(cur, n);
    *len = n;
    return (const char *)k;
}

uint64_t cring__store_timeout_ms(double timeout_s) {
    if (!(timeout_s > 0)) return 0;
    double ms = ceil(timeout_s * 1000.0);
    if (ms >= (double)STORE_MAX_TIMEOUT_MS) return STORE_MAX_TIMEOUT_MS;
    return (uint64_t)ms;
}

double cring__store_deadline(uint64_t timeout_ms, double now_s) {
    if (timeout_ms >= STORE_MAX_TIMEOUT_MS) return INFINITY;
    return now_s + (double)timeout_ms / 1000.0;
}
