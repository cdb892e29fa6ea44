/* store_protocol.h: the rendezvous store's wire protocol, shared by its server
 * (store_server.c) and client (store_client.c): message layout, the table of
 * opcodes and reply statuses, encoders and a bounds-checked decoder. No I/O.
 * Internal to csrc/bootstrap: other layers use the cring_store_* API. */
#ifndef CRING_BOOTSTRAP_STORE_PROTOCOL_H
#define CRING_BOOTSTRAP_STORE_PROTOCOL_H

#include <stddef.h>
#include <stdint.h>

#include "../common/auth.h"

/* ---- Wire protocol ----------------------------------------------------------
 * Handshake: server -> "CRS1" + 16-byte nonce; client -> "CRS1" +
 * HMAC-SHA256(secret, nonce); server -> one status byte (0 accepted; anything
 * else refused, then the server closes). A server without a secret uses the
 * empty key, so only clients without a secret match it.
 *
 * Request: [u32 length][u8 opcode][payload], length = 1 + payload bytes, at
 * most STORE_MAX_MESSAGE_BYTES. Reply: [u32 length][u8 status][payload].
 * Integers are little-endian (common/wire.h). A key is [u32 key_len][key
 * bytes], key_len <= STORE_MAX_KEY_BYTES. The requests (CRING__STORE_OPS):
 *   SET  key, value (rest of message)          -> OK
 *   GET  u64 timeout_ms, key                    -> OK value | TIMEOUT key
 *   ADD  key, i64 delta                         -> OK i64 new value | NOT_INTEGER
 *   WAIT u64 timeout_ms, u32 nkeys, key * nkeys -> OK | TIMEOUT first-missing-key
 * Any request may also be answered NO_MEMORY. GET and WAIT replies are
 * deferred until the keys exist; the server itself answers TIMEOUT when
 * timeout_ms passes, so the connection stays in step and the client remains
 * usable after a timed-out get. timeout_ms >= STORE_MAX_TIMEOUT_MS means
 * forever. Requests on one connection are answered in order. A malformed
 * message closes that connection only. */
#define STORE_MAGIC "CRS1"
#define STORE_MAGIC_BYTES 4
#define STORE_MAX_MESSAGE_BYTES (64u << 20)
#define STORE_MAX_KEY_BYTES 4096u
/* Longest server-side wait honoured (about 30 years); longer means forever. */
#define STORE_MAX_TIMEOUT_MS 1000000000000ull
/* [u32 length][u8 opcode or status] */
#define STORE_HEAD_BYTES 5

#define SERVER_HELLO_BYTES (STORE_MAGIC_BYTES + CRING__NONCE_BYTES)
#define CLIENT_HELLO_BYTES (STORE_MAGIC_BYTES + CRING__AUTH_BYTES)

/* X(name, opcode, text): the requests. */
#define CRING__STORE_OPS(X)                                                                        \
    X(SET, 1, "set")                                                                               \
    X(GET, 2, "get")                                                                               \
    X(ADD, 3, "add")                                                                               \
    X(WAIT, 4, "wait")

/* X(name, code, text): the reply statuses. */
#define CRING__STORE_REPLIES(X)                                                                    \
    X(OK, 0, "ok")                                                                                 \
    X(TIMEOUT, 1, "timeout")                                                                       \
    X(NOT_INTEGER, 2, "not an 8-byte integer")                                                     \
    X(NO_MEMORY, 3, "server out of memory")

typedef enum {
#define CRING__STORE_OP_ENUM(name, code, text) STORE_OP_##name = code,
    CRING__STORE_OPS(CRING__STORE_OP_ENUM)
#undef CRING__STORE_OP_ENUM
} cring__store_op_t;

typedef enum {
#define CRING__STORE_REPLY_ENUM(name, code, text) STORE_REPLY_##name = code,
    CRING__STORE_REPLIES(CRING__STORE_REPLY_ENUM)
#undef CRING__STORE_REPLY_ENUM
} cring__store_reply_t;

/* The text of an opcode / reply status; "unknown" for anything else. */
const char *cring__store_op_name(unsigned op);
const char *cring__store_reply_name(unsigned status);

/* ---- Encoding (into a caller's buffer; each returns the bytes written) ---- */

/* [u32 1 + payload_len][code]: the head of a request (code = opcode) or of
 * a reply (code = status) whose payload_len bytes follow. */
size_t cring__store_put_head(uint8_t *buf, uint8_t code, size_t payload_len);
/* [u32 len][key bytes] */
size_t cring__store_put_key(uint8_t *buf, const char *key, size_t len);
/* A u32 / u64, little-endian. */
size_t cring__store_put_u32(uint8_t *buf, uint32_t v);
size_t cring__store_put_u64(uint8_t *buf, uint64_t v);

/* ---- Decoding -------------------------------------------------------------- */

/* The length field at the start of a head (the bytes after it). */
uint32_t cring__store_head_length(const uint8_t *head);
/* Whether a length field is acceptable: 1 .. STORE_MAX_MESSAGE_BYTES. */
int cring__store_length_ok(uint32_t len);
uint64_t cring__store_get_u64(const uint8_t *p);

/* A cursor over one message's payload; any overrun (or a key over
 * STORE_MAX_KEY_BYTES) sets bad and later reads return zeros / NULL. */
typedef struct cring__store_cursor {
    const uint8_t *p;
    size_t left;
    int bad;
} cring__store_cursor_t;

const uint8_t *cring__store_take(cring__store_cursor_t *cur, size_t n);
uint32_t cring__store_take_u32(cring__store_cursor_t *cur);
uint64_t cring__store_take_u64(cring__store_cursor_t *cur);
/* A key [u32 len][bytes]; *len is set. The key is not NUL-terminated. */
const char *cring__store_take_key(cring__store_cursor_t *cur, size_t *len);

/* ---- Timeouts ---------------------------------------------------------------- */

/* A client's timeout in seconds as the wire's timeout_ms (<= 0: 0, capped at
 * STORE_MAX_TIMEOUT_MS), and the server's deadline for one (INFINITY when
 * at the cap). */
uint64_t cring__store_timeout_ms(double timeout_s);
double cring__store_deadline(uint64_t timeout_ms, double now_s);

#endif /* CRING_BOOTSTRAP_STORE_PROTOCOL_H */
