/* test_auth.c: SHA-256 against the FIPS 180-4 example vectors, HMAC-SHA256
 * against RFC 4231 test cases, the handshake helpers' basic properties.
 * Pure computation: no sockets, finishes in well under a second. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/auth.h"
#include "testutil.h"

static void to_hex(const uint8_t *d, size_t n, char *out) {
    for (size_t i = 0; i < n; i++) sprintf(out + 2 * i, "%02x", d[i]);
}

static int sha_is(const void *data, size_t len, const char *hex) {
    uint8_t d[32];
    char h[65];
    cring__sha256(data, len, d);
    to_hex(d, 32, h);
    if (strcmp(h, hex) != 0) fprintf(stderr, "sha256 got %s\n    expected %s\n", h, hex);
    return strcmp(h, hex) == 0;
}

static int hmac_is(const void *key, size_t key_len, const void *msg, size_t msg_len,
                   const char *hex) {
    uint8_t d[32];
    char h[65];
    cring__hmac_sha256(key, key_len, msg, msg_len, d);
    to_hex(d, 32, h);
    if (strcmp(h, hex) != 0) fprintf(stderr, "hmac got %s\n  expected %s\n", h, hex);
    return strcmp(h, hex) == 0;
}

int main(void) {
    alarm(30); /* watchdog */

    /* FIPS 180-4 examples (NIST CSRC "SHA256.pdf" and the one-million-'a' vector). */
    CHECK(sha_is("abc", 3, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"));
    CHECK(sha_is("", 0, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"));
    const char *m448 = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";
    CHECK(strlen(m448) == 56);
    CHECK(sha_is(m448, 56, "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"));
    size_t million = 1000000;
    char *a = malloc(million);
    CHECK(a != NULL);
    memset(a, 'a', million);
    CHECK(sha_is(a, million, "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0"));
    free(a);
    /* Lengths around the padding boundary (55/56/63/64 bytes) must not crash and
     * must differ from each other. */
    uint8_t prev[32] = {0}, cur[32];
    char buf[130];
    memset(buf, 'x', sizeof buf);
    for (size_t n = 50; n < 130; n++) {
        cring__sha256(buf, n, cur);
        CHECK(memcmp(prev, cur, 32) != 0);
        memcpy(prev, cur, 32);
    }

    /* RFC 4231 test case 1: key = 20 x 0x0b, data = "Hi There". */
    uint8_t key1[20];
    memset(key1, 0x0b, sizeof key1);
    CHECK(hmac_is(key1, sizeof key1, "Hi There", 8,
                  "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"));
    /* RFC 4231 test case 2: key = "Jefe", data = "what do ya want for nothing?". */
    CHECK(hmac_is("Jefe", 4, "what do ya want for nothing?", 28,
                  "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"));
    /* RFC 4231 test case 6: a 131-byte key (hashed first). */
    uint8_t key6[131];
    memset(key6, 0xaa, sizeof key6);
    const char *data6 = "Test Using Larger Than Block-Size Key - Hash Key First";
    CHECK(hmac_is(key6, sizeof key6, data6, strlen(data6),
                  "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"));

    /* The handshake response is HMAC(secret, nonce); NULL secret == "". */
    uint8_t nonce[CRING__NONCE_BYTES], r1[32], r2[32], r3[32], h[32];
    for (int i = 0; i < CRING__NONCE_BYTES; i++) nonce[i] = (uint8_t)i;
    cring__auth_response("s3cret", nonce, r1);
    cring__hmac_sha256("s3cret", 6, nonce, sizeof nonce, h);
    CHECK(memcmp(r1, h, 32) == 0);
    cring__auth_response(NULL, nonce, r2);
    cring__auth_response("", nonce, r3);
    CHECK(memcmp(r2, r3, 32) == 0);
    CHECK(cring__auth_equal(r2, r3) == 1);
    CHECK(cring__auth_equal(r1, r2) == 0);
    r3[31] ^= 1;
    CHECK(cring__auth_equal(r2, r3) == 0);

    /* Random bytes: two 32-byte draws differ and are not all zero. */
    uint8_t x[32] = {0}, y[32] = {0}, zero[32] = {0};
    cring__random_bytes(x, sizeof x);
    cring__random_bytes(y, sizeof y);
    CHECK(memcmp(x, y, 32) != 0);
    CHECK(memcmp(x, zero, 32) != 0);

    TEST_DONE("test_auth");
    return 0;
}
