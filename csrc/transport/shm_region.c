/* shm_region.c: shared regions beside the segment: one file in /dev/shm per
 * rank, created and sized by its owner and mapped by every peer on the host,
 * so algorithms can read a peer's buffer in place. Only files and mappings:
 * no store traffic, no agreement (core/regions.c does that). */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../common/auth.h"
#include "transport.h"

cring_status_t cring__shm_region_create(size_t nbytes, char *name, size_t name_len, void **out,
                                        cring__errmsg_t *err) {
    uint8_t rnd[8];
    *out = NULL;
    cring__random_bytes(rnd, sizeof rnd);
    snprintf(name, name_len, "/cring-region-%d-%02x%02x%02x%02x%02x%02x%02x%02x", (int)getpid(),
             rnd[0], rnd[1], rnd[2], rnd[3], rnd[4], rnd[5], rnd[6], rnd[7]);
    int fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0)
        return cring__fail(err, CRING_ERR_SYSTEM, "shm_open(%s) failed: %s", name, strerror(errno));
    cring_status_t st = CRING_OK;
    if (ftruncate(fd, (off_t)nbytes) != 0) {
        st = cring__fail(err, CRING_ERR_SYSTEM, "cannot size shared region %s to %zu bytes: %s",
                         name, nbytes, strerror(errno));
        goto cleanup;
    }
    void *p = mmap(NULL, nbytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
        st = cring__fail(err, CRING_ERR_SYSTEM, "mmap of a %zu-byte shared region failed: %s",
                         nbytes, strerror(errno));
        goto cleanup;
    }
    *out = p;
cleanup:
    close(fd);
    if (st != CRING_OK) shm_unlink(name);
    return st;
}

cring_status_t cring__shm_region_open(const char *name, size_t nbytes, void **out,
                                      cring__errmsg_t *err) {
    *out = NULL;
    int fd = shm_open(name, O_RDWR, 0600);
    if (fd < 0)
        return cring__fail(err, CRING_ERR_NOT_SUPPORTED, "cannot open shared region %s: %s", name,
                           strerror(errno));
    cring_status_t st = CRING_OK;
    struct stat sb;
    if (fstat(fd, &sb) != 0 || (size_t)sb.st_size != nbytes) {
        st = cring__fail(err, CRING_ERR_MISMATCH, "shared region %s has %lld bytes, not %zu", name,
                         (long long)sb.st_size, nbytes);
        goto cleanup;
    }
    void *p = mmap(NULL, nbytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
        st = cring__fail(err, CRING_ERR_SYSTEM, "mmap of shared region %s failed: %s", name,
                         strerror(errno));
        goto cleanup;
    }
    *out = p;
cleanup:
    close(fd);
    return st;
}

void cring__shm_region_unlink(const char *name) { shm_unlink(name); }

void cring__shm_region_unmap(void *base, size_t nbytes) {
    if (base) munmap(base, nbytes);
}
