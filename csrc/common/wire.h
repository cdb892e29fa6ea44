/* wire.h: little-endian integers on the wire, the one copy every protocol
 * (store messages, TCP frames, engine negotiation records) uses. Pure byte
 * math: no I/O, no allocation. */
#ifndef CRING_COMMON_WIRE_H
#define CRING_COMMON_WIRE_H

#include <stdint.h>

/* Write the low n bytes (1..8) of v at *p, least significant first, and
 * advance *p past them. */
static inline void cring__wire_put(uint8_t **p, uint64_t v, int n) {
    for (int i = 0; i < n; i++) (*p)[i] = (uint8_t)(v >> (8 * i));
    *p += n;
}

/* Read n bytes (1..8) at p, least significant first. */
static inline uint64_t cring__wire_get(const uint8_t *p, int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; i++) v |= (uint64_t)p[i] << (8 * i);
    return v;
}

static inline void cring__wire_put_u32(uint8_t *p, uint32_t v) {
    uint8_t *q = p;
    cring__wire_put(&q, v, 4);
}

static inline uint32_t cring__wire_get_u32(const uint8_t *p) {
    return (uint32_t)cring__wire_get(p, 4);
}

#endif /* CRING_COMMON_WIRE_H */
