/* strmap.h: a small string-keyed hash map (chained, growing) for the engine's
 * tables. Keys are copied; values are caller pointers. Not thread-safe. */
#ifndef CRING_STRMAP_H
#define CRING_STRMAP_H

#include <stddef.h>

typedef struct cring__strmap_entry {
    char *key;
    size_t hash; /* of key: compared before the text, kept for growing */
    void *value;
    struct cring__strmap_entry *next;
    int owns_key;
} cring__strmap_entry_t;

typedef struct cring__strmap {
    cring__strmap_entry_t **buckets;
    size_t nbuckets;
    size_t count;
    cring__strmap_entry_t *spare; /* recycled entries */
} cring__strmap_t;

/* The hash a key is stored under: callers that look the same key up
 * several times (a request's name) compute it once and use the _h forms. */
size_t cring__strmap_hash(const char *key);
/* Lookup: the value, or NULL when absent. */
void *cring__strmap_get(const cring__strmap_t *m, const char *key);
/* Insert or replace. Returns 0, or -1 when out of memory. */
int cring__strmap_put(cring__strmap_t *m, const char *key, void *value);
/* The same without copying the key: the caller keeps `key` alive and
 * unchanged until the entry is removed (saves an allocation per insert). */
int cring__strmap_put_borrowed(cring__strmap_t *m, const char *key, void *value);
/* Remove and return the value (NULL when absent). */
void *cring__strmap_remove(cring__strmap_t *m, const char *key);
/* The same with the key's cring__strmap_hash given. */
void *cring__strmap_get_h(const cring__strmap_t *m, const char *key, size_t hash);
int cring__strmap_put_borrowed_h(cring__strmap_t *m, const char *key, size_t hash, void *value);
void *cring__strmap_remove_h(cring__strmap_t *m, const char *key, size_t hash);
/* Free the table and keys (not the values). */
void cring__strmap_free(cring__strmap_t *m);

#endif
