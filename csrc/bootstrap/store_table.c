/* store_table.c: the store server's key-value table (store_table.h): FNV-1a
 * hashing, chaining, doubling growth. No I/O and no locking. */
#include "store_table.h"

#include <stdlib.h>
#include <string.h>

static uint64_t kv_hash(const char *key, size_t len) {
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (size_t i = 0; i < len; i++) h = (h ^ (uint8_t)key[i]) * 1099511628211ull;
    return h;
}

cring__kv_entry_t *cring__kv_find(const cring__kv_table_t *t, const char *key, size_t len) {
    if (t->nbuckets == 0) return NULL;
    uint64_t h = kv_hash(key, len);
    for (cring__kv_entry_t *e = t->buckets[h & (t->nbuckets - 1)]; e; e = e->next)
        if (e->hash == h && e->key_len == len && memcmp(e->key, key, len) == 0) return e;
    return NULL;
}

static int kv_grow(cring__kv_table_t *t) {
    size_t n = t->nbuckets ? t->nbuckets * 2 : 64;
    cring__kv_entry_t **b = calloc(n, sizeof *b);
    if (!b) return -1;
    for (size_t i = 0; i < t->nbuckets; i++) {
        cring__kv_entry_t *e = t->buckets[i];
        while (e) {
            cring__kv_entry_t *next = e->next;
            e->next = b[e->hash & (n - 1)];
            b[e->hash & (n - 1)] = e;
            e = next;
        }
    }
    free(t->buckets);
    t->buckets = b;
    t->nbuckets = n;
    return 0;
}

/* Contract: see store_table.h. */
int cring__kv_put(cring__kv_table_t *t, const char *key, size_t len, const void *value,
                  size_t value_len, int *created) {
    *created = 0;
    uint8_t *copy = malloc(value_len ? value_len : 1);
    if (!copy) return -1;
    if (value_len) memcpy(copy, value, value_len);
    cring__kv_entry_t *e = cring__kv_find(t, key, len);
    if (e) {
        free(e->value);
        e->value = copy;
        e->value_len = value_len;
        return 0;
    }
    if (t->count >= t->nbuckets && kv_grow(t) != 0) {
        free(copy);
        return -1;
    }
    e = malloc(sizeof *e + len + 1);
    if (!e) {
        free(copy);
        return -1;
    }
    e->hash = kv_hash(key, len);
    e->value = copy;
    e->value_len = value_len;
    e->key_len = len;
    memcpy(e->key, key, len);
    e->key[len] = '\0';
    e->next = t->buckets[e->hash & (t->nbuckets - 1)];
    t->buckets[e->hash & (t->nbuckets - 1)] = e;
    t->count++;
    *created = 1;
    return 0;
}

void cring__kv_free(cring__kv_table_t *t) {
    for (size_t i = 0; i < t->nbuckets; i++) {
        cring__kv_entry_t *e = t->buckets[i];
        while (e) {
            cring__kv_entry_t *next = e->next;
            free(e->value);
            free(e);
            e = next;
        }
    }
    free(t->buckets);
    memset(t, 0, sizeof *t);
}
