/* store_table.h: the rendezvous store server's key-value table: a chained
 * hash table of byte-string keys and values. Single-threaded (the server
 * thread owns it); knows nothing of connections or the wire. */
#ifndef CRING_BOOTSTRAP_STORE_TABLE_H
#define CRING_BOOTSTRAP_STORE_TABLE_H

#include <stddef.h>
#include <stdint.h>

typedef struct cring__kv_entry {
    struct cring__kv_entry *next;
    uint64_t hash;
    uint8_t *value;
    size_t value_len;
    size_t key_len;
    char key[];
} cring__kv_entry_t;

typedef struct cring__kv_table {
    cring__kv_entry_t **buckets;
    size_t nbuckets; /* power of two */
    size_t count;
} cring__kv_table_t;

/* The entry of key[0..len), or NULL. */
cring__kv_entry_t *cring__kv_find(const cring__kv_table_t *t, const char *key, size_t len);
/* Set key to a copy of value (the table owns it). *created is 1 when the key
 * is new. Returns 0, or -1 when out of memory (the table is unchanged). */
int cring__kv_put(cring__kv_table_t *t, const char *key, size_t len, const void *value,
                  size_t value_len, int *created);
/* Free every entry; the table is empty (and reusable) afterwards. */
void cring__kv_free(cring__kv_table_t *t);

#endif /* CRING_BOOTSTRAP_STORE_TABLE_H */
