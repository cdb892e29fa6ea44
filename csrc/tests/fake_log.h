/* fake_log.h: the one log writer of the test doubles (fake_device.c for the
 * fake CUDA runtime, fake_nccl.c for the fake NCCL; separate libraries, so a
 * static inline here rather than a shared object). Never used outside tests. */
#ifndef CRING_FAKE_LOG_H
#define CRING_FAKE_LOG_H

#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

/* Append "pid=<pid> <message>\n" to the file named by the environment
 * variable env_var, if it is set and not empty; silently nothing otherwise.
 * One write per line, so lines of several processes never interleave. */
static inline void fake_vlog(const char *env_var, const char *fmt, va_list ap) {
    const char *path = getenv(env_var);
    if (!path || !*path) return;
    char line[512];
    int n = snprintf(line, sizeof line, "pid=%d ", (int)getpid());
    n += vsnprintf(line + n, sizeof line - (size_t)n - 1, fmt, ap);
    if (n > (int)sizeof line - 2) n = (int)sizeof line - 2;
    line[n++] = '\n';
    int fd = open(path, O_WRONLY | O_APPEND | O_CREAT, 0644);
    if (fd < 0) return;
    ssize_t w = write(fd, line, (size_t)n);
    (void)w;
    close(fd);
}

#endif
