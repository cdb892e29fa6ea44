/* auth.h: the job-secret handshake used by the store and the TCP transport:
 * the server sends a random nonce, the client answers HMAC-SHA256(secret,
 * nonce). The secret never crosses the wire. No sockets here. */
#ifndef CRING_AUTH_H
#define CRING_AUTH_H

#include <stddef.h>
#include <stdint.h>

#define CRING__NONCE_BYTES 16
#define CRING__AUTH_BYTES 32

/* Fill buf with n bytes from the kernel's random source (getrandom). */
void cring__random_bytes(void *buf, size_t n);
/* out = HMAC-SHA256(key = secret (may be NULL: empty), message = nonce). */
void cring__auth_response(const char *secret, const uint8_t nonce[CRING__NONCE_BYTES],
                          uint8_t out[CRING__AUTH_BYTES]);
/* Constant-time comparison of two responses: 1 if equal. */
int cring__auth_equal(const uint8_t a[CRING__AUTH_BYTES], const uint8_t b[CRING__AUTH_BYTES]);
/* SHA-256 of data (exposed for tests against published vectors). */
void cring__sha256(const void *data, size_t len, uint8_t out[32]);
/* out = HMAC-SHA256(key[0..key_len), msg[0..msg_len)) per RFC 2104; keys longer
 * than 64 bytes are hashed first. Exposed for tests against RFC 4231. */
void cring__hmac_sha256(const void *key, size_t key_len, const void *msg, size_t msg_len,
                        uint8_t out[32]);

#endif /* CRING_AUTH_H */
