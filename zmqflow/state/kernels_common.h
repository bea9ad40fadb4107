/* What the compiled loops share (kernels_c.c, fold_c.c): the buffer checks and the GIL rule. */

#ifndef ZMQFLOW_KERNELS_COMMON_H
#define ZMQFLOW_KERNELS_COMMON_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define RELEASE_GIL_FROM 65536 /* elements: below this the GIL's round trip costs more than it frees */
/* 'f' or 'd' for a float32 or float64 buffer (any byte-order mark of the native order), else 0 */
static inline char type_of(const Py_buffer *b) {
    const char *f = b->format ? b->format : "B";
    if (f[0] == '<' || f[0] == '=' || f[0] == '@')
        f++;
    return (f[0] == 'f' || f[0] == 'd') && f[1] == '\0' ? f[0] : 0;
}

static inline int overlap(const Py_buffer *x, const Py_buffer *y) {
    return (const char *)x->buf < (const char *)y->buf + y->len && (const char *)y->buf < (const char *)x->buf + x->len;
}

/* Run STMT with the GIL released for big arrays. */
#define MAYBE_WITHOUT_GIL(count, STMT) \
    do {                               \
        if ((count) >= RELEASE_GIL_FROM) { \
            Py_BEGIN_ALLOW_THREADS STMT; Py_END_ALLOW_THREADS \
        } else {                       \
            STMT;                      \
        }                              \
    } while (0)

#endif
