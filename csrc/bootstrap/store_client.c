/* store_client.c: the rendezvous store's blocking client: connect with retry
 * and the handshake, then set / get / add / wait, each one request and one
 * reply (layout in store_protocol.h). Any transport failure closes the client. */
#include <inttypes.h>
#include <math.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "../common/auth.h"
#include "../common/common.h"
#include "../common/net.h"
#include "store_protocol.h"

struct cring_store {
    int fd;              /* -1 once broken */
    double op_timeout_s; /* bound on set/add round trips and on sends */
    char addr[256];
    int port;
};

/* Extra time a client waits beyond its GET/WAIT timeout for the server's own
 * TIMEOUT answer before it gives up on the connection. */
#define CLIENT_REPLY_GRACE_S 10.0
/* Floor for the set/add round-trip bound. */
#define CLIENT_MIN_OP_TIMEOUT_S 30.0

static void client_break(cring_store_t *c) {
    if (c->fd >= 0) close(c->fd);
    c->fd = -1;
}

static cring_status_t client_usable(cring_store_t *c) {
    if (!c)
        return cring__fail(cring__thread_errmsg(), CRING_ERR_INVALID_ARGUMENT,
                           "store client is NULL");
    if (c->fd < 0)
        return cring__fail(cring__thread_errmsg(), CRING_ERR_BROKEN,
                           "store client for %s:%d is unusable after an earlier failure", c->addr,
                           c->port);
    return CRING_OK;
}

static cring_status_t check_key(const char *key, size_t *len) {
    if (!key)
        return cring__fail(cring__thread_errmsg(), CRING_ERR_INVALID_ARGUMENT, "store key is NULL");
    *len = strlen(key);
    if (*len > STORE_MAX_KEY_BYTES)
        return cring__fail(cring__thread_errmsg(), CRING_ERR_INVALID_ARGUMENT,
                           "store key of %zu bytes is over the %u byte limit", *len,
                           STORE_MAX_KEY_BYTES);
    return CRING_OK;
}

/* Send the parts of one request, then read the reply [u32 len][u8 status]
 * [payload]; *payload_out is malloc'd (NULL when empty). Any transport
 * failure breaks the client (the stream would be out of step). */
static cring_status_t client_call(cring_store_t *c, const uint8_t *head, size_t head_len,
                                  const void *tail, size_t tail_len, double reply_deadline,
                                  const char *what, uint8_t *status_out, uint8_t **payload_out,
                                  size_t *payload_len_out) {
    cring__errmsg_t *err = cring__thread_errmsg();
    cring__errmsg_t detail;
    cring_status_t st;
    uint8_t *payload = NULL;
    *payload_out = NULL;
    *payload_len_out = 0;
    double send_deadline = cring__now_s() + c->op_timeout_s;
    CRING_CHECK_GOTO(cring__net_send_all(c->fd, head, head_len, send_deadline, &detail), st,
                     cleanup);
    if (tail_len)
        CRING_CHECK_GOTO(cring__net_send_all(c->fd, tail, tail_len, send_deadline, &detail), st,
                         cleanup);
    uint8_t reply_head[STORE_HEAD_BYTES];
    CRING_CHECK_GOTO(
        cring__net_recv_all(c->fd, reply_head, sizeof reply_head, reply_deadline, &detail), st,
        cleanup);
    uint32_t len = cring__store_head_length(reply_head);
    if (!cring__store_length_ok(len)) {
        st = cring__fail(&detail, CRING_ERR_PROTOCOL, "reply of %" PRIu32 " bytes is malformed",
                         len);
        goto cleanup;
    }
    size_t payload_len = (size_t)len - 1;
    if (payload_len) {
        payload = malloc(payload_len + 1); /* + a NUL so string values are usable as is */
        if (!payload) {
            st = cring__fail(&detail, CRING_ERR_NO_MEMORY, "out of memory for a %zu byte reply",
                             payload_len);
            goto cleanup;
        }
        CRING_CHECK_GOTO(cring__net_recv_all(c->fd, payload, payload_len, reply_deadline, &detail),
                         st, cleanup);
        payload[payload_len] = 0;
    }
    *status_out = reply_head[4];
    *payload_out = payload;
    *payload_len_out = payload_len;
    return CRING_OK;

cleanup:
    free(payload);
    client_break(c);
    return cring__fail(err, st, "store %s at %s:%d failed: %s (client closed)", what, c->addr,
                       c->port, detail.text);
}

/* Map a non-OK reply status to an error. */
static cring_status_t reply_error(cring_store_t *c, uint8_t status, const char *what,
                                  const char *key) {
    cring__errmsg_t *err = cring__thread_errmsg();
    switch (status) {
    case STORE_REPLY_NOT_INTEGER:
        return cring__fail(err, CRING_ERR_INVALID_ARGUMENT,
                           "store %s of key '%s' at %s:%d: the value is not an 8-byte integer",
                           what, key, c->addr, c->port);
    case STORE_REPLY_NO_MEMORY:
        return cring__fail(err, CRING_ERR_NO_MEMORY,
                           "store %s of key '%s' at %s:%d: server is out of memory", what, key,
                           c->addr, c->port);
    default:
        return cring__fail(err, CRING_ERR_PROTOCOL,
                           "store %s of key '%s' at %s:%d: unexpected reply status %u", what, key,
                           c->addr, c->port, status);
    }
}

/* Contract: see cring.h. addr/secret are copied; timeout_s <= 0 means 600 s.
 * Refused or unreachable attempts, and handshakes cut short (a server that is
 * restarting), are retried until the deadline. Set/add round trips later are
 * bounded by max(timeout_s, 30 s). Errors: ERR_TIMEOUT, ERR_AUTH (the server
 * refused the secret), ERR_PROTOCOL (not a cring store), ERR_INVALID_ARGUMENT,
 * ERR_SYSTEM, ERR_NO_MEMORY; detail in cring__thread_errmsg(). */
cring_status_t cring_store_connect(const char *addr, int port, const char *secret, double timeout_s,
                                   cring_store_t **client_out) {
    cring__errmsg_t *err = cring__thread_errmsg();
    cring__errmsg_t detail;
    cring_status_t st = CRING_OK;
    int fd = -1;
    if (!client_out) return cring__fail(err, CRING_ERR_INVALID_ARGUMENT, "client_out is NULL");
    *client_out = NULL;
    if (!addr || !*addr)
        return cring__fail(err, CRING_ERR_INVALID_ARGUMENT, "store address is empty");
    if (strlen(addr) >= sizeof(((cring_store_t *)0)->addr))
        return cring__fail(err, CRING_ERR_INVALID_ARGUMENT, "store address is too long");
    if (!(timeout_s > 0)) timeout_s = 600.0;
    double deadline = cring__now_s() + timeout_s;
    cring_store_t *c = calloc(1, sizeof *c);
    if (!c) return cring__fail(err, CRING_ERR_NO_MEMORY, "out of memory for a store client");
    c->fd = -1;
    snprintf(c->addr, sizeof c->addr, "%s", addr);
    c->port = port;
    c->op_timeout_s = CRING_MAX(timeout_s, CLIENT_MIN_OP_TIMEOUT_S);

    for (;;) {
        st = cring__net_connect(addr, port, deadline, &fd, &detail);
        if (st != CRING_OK) {
            if (st == CRING_ERR_TIMEOUT)
                st = cring__fail(err, st,
                                 "could not reach the rendezvous store at %s:%d within %.1f s: %s",
                                 addr, port, timeout_s, detail.text);
            else
                st = cring__fail(err, st, "cannot connect to the rendezvous store at %s:%d: %s",
                                 addr, port, detail.text);
            goto cleanup;
        }
        uint8_t hello[SERVER_HELLO_BYTES];
        st = cring__net_recv_all(fd, hello, sizeof hello, deadline, &detail);
        if (st == CRING_OK && memcmp(hello, STORE_MAGIC, STORE_MAGIC_BYTES) != 0) {
            st = cring__fail(err, CRING_ERR_PROTOCOL,
                             "%s:%d is not a cring rendezvous store (bad greeting)", addr, port);
            goto cleanup;
        }
        uint8_t answer[CLIENT_HELLO_BYTES];
        if (st == CRING_OK) {
            memcpy(answer, STORE_MAGIC, STORE_MAGIC_BYTES);
            cring__auth_response(secret, hello + STORE_MAGIC_BYTES, answer + STORE_MAGIC_BYTES);
            st = cring__net_send_all(fd, answer, sizeof answer, deadline, &detail);
        }
        uint8_t verdict = 1;
        if (st == CRING_OK) st = cring__net_recv_all(fd, &verdict, 1, deadline, &detail);
        if (st == CRING_OK) {
            if (verdict != 0) {
                st = cring__fail(err, CRING_ERR_AUTH,
                                 "the rendezvous store at %s:%d refused this process's job "
                                 "secret (do the secrets match?)",
                                 addr, port);
                goto cleanup;
            }
            break;
        }
        close(fd);
        fd = -1;
        if (st == CRING_ERR_TIMEOUT) {
            st = cring__fail(err, st,
                             "the rendezvous store at %s:%d did not finish the handshake within "
                             "%.1f s: %s",
                             addr, port, timeout_s, detail.text);
            goto cleanup;
        }
        if (st != CRING_ERR_PEER_FAILURE || cring__now_s() >= deadline) {
            st = cring__fail(err, st, "handshake with the rendezvous store at %s:%d failed: %s",
                             addr, port, detail.text);
            goto cleanup;
        }
        (void)poll(NULL, 0, 20); /* the server went away mid-handshake: back off, retry */
    }
    c->fd = fd;
    *client_out = c;
    return CRING_OK;

cleanup:
    if (fd >= 0) close(fd);
    free(c);
    return st;
}

/* Contract: see cring.h. */
void cring_store_close(cring_store_t *client) {
    if (!client) return;
    client_break(client);
    free(client);
}

/* Contract: see cring.h. Returns once the server has stored the value.
 * Errors: ERR_INVALID_ARGUMENT (key over 4096 bytes, value over ~64 MiB),
 * ERR_BROKEN, ERR_PEER_FAILURE / ERR_TIMEOUT (the client is then broken). */
cring_status_t cring_store_set(cring_store_t *client, const char *key, const void *value,
                               size_t len) {
    size_t klen = 0;
    CRING_CHECK(client_usable(client));
    CRING_CHECK(check_key(key, &klen));
    if (len && !value)
        return cring__fail(cring__thread_errmsg(), CRING_ERR_INVALID_ARGUMENT, "value is NULL");
    size_t body = 4 + klen;
    if (len > STORE_MAX_MESSAGE_BYTES - 1 - body)
        return cring__fail(cring__thread_errmsg(), CRING_ERR_INVALID_ARGUMENT,
                           "store value of %zu bytes is over the %u byte message limit", len,
                           STORE_MAX_MESSAGE_BYTES);
    uint8_t head[STORE_HEAD_BYTES + 4 + STORE_MAX_KEY_BYTES];
    size_t n = cring__store_put_head(head, STORE_OP_SET, body + len); /* the value follows */
    n += cring__store_put_key(head + n, key, klen);
    uint8_t status;
    uint8_t *payload;
    size_t payload_len;
    CRING_CHECK(client_call(client, head, n, value, len, cring__now_s() + client->op_timeout_s,
                            "set", &status, &payload, &payload_len));
    free(payload);
    if (status != STORE_REPLY_OK) return reply_error(client, status, "set", key);
    return CRING_OK;
}

/* Contract: see cring.h. The server answers TIMEOUT itself when timeout_s
 * passes, so after ERR_TIMEOUT the client stays usable; only if the server
 * does not answer within timeout_s + 10 s is the client closed (later calls
 * give ERR_BROKEN). timeout_s <= 0 checks once without waiting. On error
 * *value_out is NULL. The buffer always has one extra NUL byte after the
 * value (so a zero-length value gives a non-NULL buffer holding "\0"). */
cring_status_t cring_store_get(cring_store_t *client, const char *key, double timeout_s,
                               void **value_out, size_t *len_out) {
    size_t klen = 0;
    if (value_out) *value_out = NULL;
    if (len_out) *len_out = 0;
    CRING_CHECK(client_usable(client));
    CRING_CHECK(check_key(key, &klen));
    if (!value_out || !len_out)
        return cring__fail(cring__thread_errmsg(), CRING_ERR_INVALID_ARGUMENT,
                           "value_out and len_out must not be NULL");
    uint64_t timeout_ms = cring__store_timeout_ms(timeout_s);
    size_t body = 8 + 4 + klen;
    uint8_t head[STORE_HEAD_BYTES + 8 + 4 + STORE_MAX_KEY_BYTES];
    size_t n = cring__store_put_head(head, STORE_OP_GET, body);
    n += cring__store_put_u64(head + n, timeout_ms);
    n += cring__store_put_key(head + n, key, klen);
    uint8_t status;
    uint8_t *payload;
    size_t payload_len;
    double reply_deadline = cring__now_s() + (double)timeout_ms / 1000.0 + CLIENT_REPLY_GRACE_S;
    CRING_CHECK(client_call(client, head, n, NULL, 0, reply_deadline, "get", &status, &payload,
                            &payload_len));
    if (status == STORE_REPLY_TIMEOUT) {
        free(payload);
        return cring__fail(cring__thread_errmsg(), CRING_ERR_TIMEOUT,
                           "key '%s' did not appear in the rendezvous store at %s:%d within %.3g s",
                           key, client->addr, client->port, timeout_s);
    }
    if (status != STORE_REPLY_OK) {
        free(payload);
        return reply_error(client, status, "get", key);
    }
    if (!payload) {
        payload = malloc(1);
        if (!payload)
            return cring__fail(cring__thread_errmsg(), CRING_ERR_NO_MEMORY, "out of memory");
        payload[0] = 0;
    }
    *value_out = payload;
    *len_out = payload_len;
    return CRING_OK;
}

/* Contract: see cring.h. The value is stored as 8 bytes little-endian;
 * arithmetic wraps modulo 2^64. Errors: ERR_INVALID_ARGUMENT (the key holds
 * a value that is not 8 bytes), ERR_BROKEN, ERR_PEER_FAILURE, ERR_TIMEOUT. */
cring_status_t cring_store_add(cring_store_t *client, const char *key, int64_t delta,
                               int64_t *new_value_out) {
    size_t klen = 0;
    CRING_CHECK(client_usable(client));
    CRING_CHECK(check_key(key, &klen));
    size_t body = 4 + klen + 8;
    uint8_t head[STORE_HEAD_BYTES + 4 + STORE_MAX_KEY_BYTES + 8];
    size_t n = cring__store_put_head(head, STORE_OP_ADD, body);
    n += cring__store_put_key(head + n, key, klen);
    n += cring__store_put_u64(head + n, (uint64_t)delta);
    uint8_t status;
    uint8_t *payload;
    size_t payload_len;
    CRING_CHECK(client_call(client, head, n, NULL, 0, cring__now_s() + client->op_timeout_s, "add",
                            &status, &payload, &payload_len));
    if (status != STORE_REPLY_OK) {
        free(payload);
        return reply_error(client, status, "add", key);
    }
    if (payload_len != 8) {
        free(payload);
        client_break(client);
        return cring__fail(cring__thread_errmsg(), CRING_ERR_PROTOCOL,
                           "store add reply from %s:%d has %zu bytes, not 8", client->addr,
                           client->port, payload_len);
    }
    uint64_t v = cring__store_get_u64(payload);
    free(payload);
    if (new_value_out) memcpy(new_value_out, &v, sizeof v);
    return CRING_OK;
}

/* Contract: see cring.h. Same timeout semantics as cring_store_get; the
 * message names the first key still missing. nkeys == 0 returns at once. */
cring_status_t cring_store_wait(cring_store_t *client, const char *const *keys, size_t nkeys,
                                double timeout_s) {
    CRING_CHECK(client_usable(client));
    if (nkeys == 0) return CRING_OK;
    if (!keys)
        return cring__fail(cring__thread_errmsg(), CRING_ERR_INVALID_ARGUMENT, "keys is NULL");
    size_t body = 8 + 4;
    for (size_t i = 0; i < nkeys; i++) {
        size_t klen = 0;
        CRING_CHECK(check_key(keys[i], &klen));
        body += 4 + klen;
        if (body > STORE_MAX_MESSAGE_BYTES - 1)
            return cring__fail(cring__thread_errmsg(), CRING_ERR_INVALID_ARGUMENT,
                               "too many keys for one store wait");
    }
    uint8_t *msg = malloc(STORE_HEAD_BYTES + body);
    if (!msg) return cring__fail(cring__thread_errmsg(), CRING_ERR_NO_MEMORY, "out of memory");
    uint64_t timeout_ms = cring__store_timeout_ms(timeout_s);
    size_t n = cring__store_put_head(msg, STORE_OP_WAIT, body);
    n += cring__store_put_u64(msg + n, timeout_ms);
    n += cring__store_put_u32(msg + n, (uint32_t)nkeys);
    for (size_t i = 0; i < nkeys; i++) n += cring__store_put_key(msg + n, keys[i], strlen(keys[i]));
    uint8_t status;
    uint8_t *payload;
    size_t payload_len;
    double reply_deadline = cring__now_s() + (double)timeout_ms / 1000.0 + CLIENT_REPLY_GRACE_S;
    cring_status_t st = client_call(client, msg, n, NULL, 0, reply_deadline, "wait", &status,
                                    &payload, &payload_len);
    free(msg);
    if (st != CRING_OK) return st;
    if (status == STORE_REPLY_TIMEOUT) {
        int shown = (int)CRING_MIN(payload_len, (size_t)200);
        st = cring__fail(cring__thread_errmsg(), CRING_ERR_TIMEOUT,
                         "key '%.*s' did not appear in the rendezvous store at %s:%d within %.3g s",
                         shown, payload ? (const char *)payload : "", client->addr, client->port,
                         timeout_s);
    } else if (status != STORE_REPLY_OK) {
        st = reply_error(client, status, "wait", keys[0]);
    }
    free(payload);
    return st;
}

/* Contract: see cring.h. Only shuts the socket down (never closes it), so it
 * is safe against a call blocked in another thread, which then fails. */
void cring_store_interrupt(cring_store_t *client) {
    if (!client) return;
    int fd = client->fd;
    if (fd >= 0) shutdown(fd, SHUT_RDWR);
}
