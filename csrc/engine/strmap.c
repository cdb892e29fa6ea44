/* strmap.c: the string-keyed hash map of strmap.h (FNV-1a, chaining,
 * doubling at load factor 1). No knowledge of what the values are. */
#include "strmap.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

size_t cring__strmap_hash(const char *s) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (; *s; s++) h = (h ^ (unsigned char)*s) * 0x100000001b3ull;
    return (size_t)(h ^ (h >> 29)); /* FNV's low bits mix poorly: fold the high ones in */
}

/* The link that holds key (or the end of its bucket's chain); the text is
 * compared only when the hashes match and the pointers differ. */
static cring__strmap_entry_t **find(const cring__strmap_t *m, const char *key, size_t h) {
    if (!m->nbuckets) return NULL;
    cring__strmap_entry_t **p = &m->buckets[h & (m->nbuckets - 1)];
    while (*p && ((*p)->hash != h || ((*p)->key != key && strcmp((*p)->key, key) != 0)))
        p = &(*p)->next;
    return p;
}

void *cring__strmap_get_h(const cring__strmap_t *m, const char *key, size_t h) {
    cring__strmap_entry_t **p = find(m, key, h);
    return p && *p ? (*p)->value : NULL;
}

void *cring__strmap_get(const cring__strmap_t *m, const char *key) {
    return cring__strmap_get_h(m, key, cring__strmap_hash(key));
}

static int grow(cring__strmap_t *m) {
    size_t n = m->nbuckets ? m->nbuckets * 2 : 64;
    cring__strmap_entry_t **b = calloc(n, sizeof *b);
    if (!b) return -1;
    for (size_t i = 0; i < m->nbuckets; i++) {
        cring__strmap_entry_t *e = m->buckets[i];
        while (e) {
            cring__strmap_entry_t *next = e->next;
            size_t j = e->hash & (n - 1);
            e->next = b[j];
            b[j] = e;
            e = next;
        }
    }
    free(m->buckets);
    m->buckets = b;
    m->nbuckets = n;
    return 0;
}

static int put(cring__strmap_t *m, const char *key, size_t h, void *value, int copy) {
    if (m->count >= m->nbuckets && grow(m) != 0) return -1;
    cring__strmap_entry_t **p = find(m, key, h);
    if (*p) {
        (*p)->value = value;
        return 0;
    }
    cring__strmap_entry_t *e = m->spare;
    if (e) m->spare = e->next;
    else if (!(e = malloc(sizeof *e))) return -1;
    e->key = copy ? strdup(key) : (char *)key;
    if (!e->key) {
        free(e);
        return -1;
    }
    e->owns_key = copy;
    e->hash = h;
    e->value = value;
    e->next = NULL;
    *p = e;
    m->count++;
    return 0;
}

int cring__strmap_put(cring__strmap_t *m, const char *key, void *value) {
    return put(m, key, cring__strmap_hash(key), value, 1);
}

int cring__strmap_put_borrowed(cring__strmap_t *m, const char *key, void *value) {
    return put(m, key, cring__strmap_hash(key), value, 0);
}

int cring__strmap_put_borrowed_h(cring__strmap_t *m, const char *key, size_t h, void *value) {
    return put(m, key, h, value, 0);
}

void *cring__strmap_remove(cring__strmap_t *m, const char *key) {
    return cring__strmap_remove_h(m, key, cring__strmap_hash(key));
}

void *cring__strmap_remove_h(cring__strmap_t *m, const char *key, size_t h) {
    cring__strmap_entry_t **p = find(m, key, h);
    if (!p || !*p) return NULL;
    cring__strmap_entry_t *e = *p;
    void *v = e->value;
    *p = e->next;
    if (e->owns_key) free(e->key);
    e->next = m->spare; /* keep it for the next insert */
    m->spare = e;
    m->count--;
    return v;
}

void cring__strmap_free(cring__strmap_t *m) {
    for (size_t i = 0; i < m->nbuckets; i++) {
        cring__strmap_entry_t *e = m->buckets[i];
        while (e) {
            cring__strmap_entry_t *next = e->next;
            if (e->owns_key) free(e->key);
            free(e);
            e = next;
        }
    }
    while (m->spare) {
        cring__strmap_entry_t *next = m->spare->next;
        free(m->spare);
        m->spare = next;
    }
    free(m->buckets);
    memset(m, 0, sizeof *m);
}
