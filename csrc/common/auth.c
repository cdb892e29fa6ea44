/* auth.c: SHA-256 (FIPS 180-4), HMAC-SHA256 (RFC 2104), random nonces and a
 * constant-time compare for the job-secret handshake. Written from the
 * standards; no sockets, no allocation, and the secret is never logged. */
#include "auth.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "common.h"

/* ---- SHA-256 ------------------------------------------------------------- */

typedef struct sha256_ctx {
    uint32_t state[8];
    uint64_t total_bytes;
    uint8_t block[64];
    size_t block_len;
} sha256_ctx_t;

/* First 32 bits of the fractional parts of the cube roots of the first 64 primes. */
static const uint32_t sha256_k[64] = {
    0x428a2f98u, 0x71374491u, 0xb5c0fbcfu, 0xe9b5dba5u, 0x3956c25bu, 0x59f111f1u, 0x923f82a4u,
    0xab1c5ed5u, 0xd807aa98u, 0x12835b01u, 0x243185beu, 0x550c7dc3u, 0x72be5d74u, 0x80deb1feu,
    0x9bdc06a7u, 0xc19bf174u, 0xe49b69c1u, 0xefbe4786u, 0x0fc19dc6u, 0x240ca1ccu, 0x2de92c6fu,
    0x4a7484aau, 0x5cb0a9dcu, 0x76f988dau, 0x983e5152u, 0xa831c66du, 0xb00327c8u, 0xbf597fc7u,
    0xc6e00bf3u, 0xd5a79147u, 0x06ca6351u, 0x14292967u, 0x27b70a85u, 0x2e1b2138u, 0x4d2c6dfcu,
    0x53380d13u, 0x650a7354u, 0x766a0abbu, 0x81c2c92eu, 0x92722c85u, 0xa2bfe8a1u, 0xa81a664bu,
    0xc24b8b70u, 0xc76c51a3u, 0xd192e819u, 0xd6990624u, 0xf40e3585u, 0x106aa070u, 0x19a4c116u,
    0x1e376c08u, 0x2748774cu, 0x34b0bcb5u, 0x391c0cb3u, 0x4ed8aa4au, 0x5b9cca4fu, 0x682e6ff3u,
    0x748f82eeu, 0x78a5636fu, 0x84c87814u, 0x8cc70208u, 0x90befffau, 0xa4506cebu, 0xbef9a3f7u,
    0xc67178f2u,
};

static uint32_t rotr32(uint32_t x, unsigned n) { return (x >> n) | (x << (32u - n)); }

static void sha256_init(sha256_ctx_t *c) {
    /* First 32 bits of the fractional parts of the square roots of the first 8 primes. */
    static const uint32_t h0[8] = {0x6a09e667u, 0xbb67ae85u, 0x3c6ef372u, 0xa54ff53au,
                                   0x510e527fu, 0x9b05688cu, 0x1f83d9abu, 0x5be0cd19u};
    memcpy(c->state, h0, sizeof h0);
    c->total_bytes = 0;
    c->block_len = 0;
}

/* Process one 512-bit block (FIPS 180-4 section 6.2.2). */
static void sha256_compress(uint32_t state[8], const uint8_t block[64]) {
    uint32_t w[64];
    for (int t = 0; t < 16; t++)
        w[t] = (uint32_t)block[4 * t] << 24 | (uint32_t)block[4 * t + 1] << 16 |
               (uint32_t)block[4 * t + 2] << 8 | (uint32_t)block[4 * t + 3];
    for (int t = 16; t < 64; t++) {
        uint32_t s0 = rotr32(w[t - 15], 7) ^ rotr32(w[t - 15], 18) ^ (w[t - 15] >> 3);
        uint32_t s1 = rotr32(w[t - 2], 17) ^ rotr32(w[t - 2], 19) ^ (w[t - 2] >> 10);
        w[t] = w[t - 16] + s0 + w[t - 7] + s1;
    }
    uint32_t a = state[0], b = state[1], c = state[2], d = state[3];
    uint32_t e = state[4], f = state[5], g = state[6], h = state[7];
    for (int t = 0; t < 64; t++) {
        uint32_t big_s1 = rotr32(e, 6) ^ rotr32(e, 11) ^ rotr32(e, 25);
        uint32_t ch = (e & f) ^ (~e & g);
        uint32_t t1 = h + big_s1 + ch + sha256_k[t] + w[t];
        uint32_t big_s0 = rotr32(a, 2) ^ rotr32(a, 13) ^ rotr32(a, 22);
        uint32_t maj = (a & b) ^ (a & c) ^ (b & c);
        uint32_t t2 = big_s0 + maj;
        h = g;
        g = f;
        f = e;
        e = d + t1;
        d = c;
        c = b;
        b = a;
        a = t1 + t2;
    }
    state[0] += a;
    state[1] += b;
    state[2] += c;
    state[3] += d;
    state[4] += e;
    state[5] += f;
    state[6] += g;
    state[7] += h;
}

static void sha256_update(sha256_ctx_t *c, const void *data, size_t len) {
    const uint8_t *p = data;
    c->total_bytes += len;
    if (c->block_len > 0) {
        size_t take = CRING_MIN(len, 64 - c->block_len);
        memcpy(c->block + c->block_len, p, take);
        c->block_len += take;
        p += take;
        len -= take;
        if (c->block_len < 64) return;
        sha256_compress(c->state, c->block);
        c->block_len = 0;
    }
    while (len >= 64) {
        sha256_compress(c->state, p);
        p += 64;
        len -= 64;
    }
    if (len > 0) {
        memcpy(c->block, p, len);
        c->block_len = len;
    }
}

/* Pad with 0x80, zeros and the 64-bit big-endian bit length (section 5.1.1). */
static void sha256_final(sha256_ctx_t *c, uint8_t out[32]) {
    uint64_t bits = c->total_bytes * 8u;
    uint8_t pad[72];
    size_t pad_len = (c->block_len < 56) ? 56 - c->block_len : 120 - c->block_len;
    memset(pad, 0, sizeof pad);
    pad[0] = 0x80;
    for (int i = 0; i < 8; i++) pad[pad_len + (size_t)i] = (uint8_t)(bits >> (56 - 8 * i));
    uint64_t saved_total = c->total_bytes;
    sha256_update(c, pad, pad_len + 8);
    c->total_bytes = saved_total;
    for (int i = 0; i < 8; i++) {
        out[4 * i] = (uint8_t)(c->state[i] >> 24);
        out[4 * i + 1] = (uint8_t)(c->state[i] >> 16);
        out[4 * i + 2] = (uint8_t)(c->state[i] >> 8);
        out[4 * i + 3] = (uint8_t)c->state[i];
    }
}

/* Contract: see auth.h. Thread-safe, no allocation. */
void cring__sha256(const void *data, size_t len, uint8_t out[32]) {
    sha256_ctx_t c;
    sha256_init(&c);
    sha256_update(&c, data, len);
    sha256_final(&c, out);
}

/* ---- HMAC-SHA256 (RFC 2104 with B = 64, L = 32) ---------------------------- */

static void hmac_sha256(const void *key, size_t key_len, const void *msg, size_t msg_len,
                        uint8_t out[32]) {
    uint8_t k0[64];
    memset(k0, 0, sizeof k0);
    if (key_len > 64) cring__sha256(key, key_len, k0); /* long keys are hashed first */
    else if (key_len > 0) memcpy(k0, key, key_len);
    uint8_t pad[64];
    uint8_t inner[32];
    sha256_ctx_t c;

    for (int i = 0; i < 64; i++) pad[i] = k0[i] ^ 0x36;
    sha256_init(&c);
    sha256_update(&c, pad, 64);
    sha256_update(&c, msg, msg_len);
    sha256_final(&c, inner);

    for (int i = 0; i < 64; i++) pad[i] = k0[i] ^ 0x5c;
    sha256_init(&c);
    sha256_update(&c, pad, 64);
    sha256_update(&c, inner, sizeof inner);
    sha256_final(&c, out);
    memset(k0, 0, sizeof k0);
}

/* Contract: see auth.h. secret NULL is the empty key. Thread-safe. */
void cring__auth_response(const char *secret, const uint8_t nonce[CRING__NONCE_BYTES],
                          uint8_t out[CRING__AUTH_BYTES]) {
    const char *key = secret ? secret : "";
    hmac_sha256(key, strlen(key), nonce, CRING__NONCE_BYTES, out);
}

/* Contract: see auth.h. Thread-safe, no allocation. */
void cring__hmac_sha256(const void *key, size_t key_len, const void *msg, size_t msg_len,
                        uint8_t out[32]) {
    hmac_sha256(key, key_len, msg, msg_len, out);
}

/* Contract: see auth.h. Time does not depend on where the inputs differ. */
int cring__auth_equal(const uint8_t a[CRING__AUTH_BYTES], const uint8_t b[CRING__AUTH_BYTES]) {
    volatile uint8_t diff = 0;
    for (int i = 0; i < CRING__AUTH_BYTES; i++) diff |= (uint8_t)(a[i] ^ b[i]);
    return diff == 0;
}

/* Contract: see auth.h. Uses getrandom(); falls back to /dev/urandom, and as
 * a last resort (no kernel source at all, logged) to a hash of clocks and
 * addresses, which is unpredictable enough only to avoid nonce reuse. */
void cring__random_bytes(void *buf, size_t n) {
    uint8_t *p = buf;
    size_t done = 0;
    while (done < n) {
        ssize_t r = getrandom(p + done, n - done, 0);
        if (r > 0) {
            done += (size_t)r;
            continue;
        }
        if (r < 0 && errno == EINTR) continue;
        break;
    }
    if (done < n) {
        int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
        if (fd >= 0) {
            while (done < n) {
                ssize_t r = read(fd, p + done, n - done);
                if (r > 0) {
                    done += (size_t)r;
                    continue;
                }
                if (r < 0 && errno == EINTR) continue;
                break;
            }
            close(fd);
        }
    }
    if (done < n) {
        cring__log(CRING__LOG_ERROR, -1, "no kernel random source; nonces are weak");
        static _Thread_local uint64_t counter;
        while (done < n) {
            struct {
                struct timespec mono, real;
                pid_t pid;
                const void *addr;
                uint64_t counter;
            } seed;
            memset(&seed, 0, sizeof seed);
            clock_gettime(CLOCK_MONOTONIC, &seed.mono);
            clock_gettime(CLOCK_REALTIME, &seed.real);
            seed.pid = getpid();
            seed.addr = &seed;
            seed.counter = ++counter;
            uint8_t h[32];
            cring__sha256(&seed, sizeof seed, h);
            size_t take = CRING_MIN(sizeof h, n - done);
            memcpy(p + done, h, take);
            done += take;
        }
    }
}
