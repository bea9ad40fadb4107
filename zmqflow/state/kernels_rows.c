/* The sum of the rows of repeated ids, in one pass (a sparse gradient's rows, summed per id), and
   the grouping of the ids that finds them, in two (below: first_seen, runs).

   numpy's way is a gather of the rows into sorted order and ``np.add.reduceat`` over them:
   reduceat along the rows walks a 4096 x 64 float32 gradient at about 0.2 GB/s (1.4 ms), the
   most of an embedding push's time on the client. Here each id's rows are read in place,
   through the sort's order, and summed into the id's output row, with reduceat's bits: reduceat
   copies a run's first row and adds to it, column by column, numpy's pairwise sum of the rest
   (``pairwise_sum`` in numpy's loops_utils.h.src: under 8 terms one by one from -0.0; up to 128
   in 8 interleaved partial sums, combined as ((0+1)+(2+3))+((4+5)+(6+7)), then the rest one by
   one; past 128 the two halves' sums, split at a multiple of 8). The same additions in the same
   order, done for ``CHUNK`` columns at a time, so each row's chunk is read once per run.

   segment_sum(out, rows, order, starts, cols, weights=None)
       rows:   m rows of ``cols`` floats, float32 ('f') or float64 ('d'), C-contiguous, aligned
       order:  n int64 row numbers in [0, m): each id's rows in the order they came (runs()); a
               row may be named more than once (a bag's rows read straight from the unique ones)
       starts: u int64, where each id's run starts in ``order``: 0 first, strictly increasing,
               each below n (a run ends where the next starts, the last at n)
       out:    u rows of ``cols`` floats of rows' type, writable, apart from ``rows``
       weights: None, or n values of rows' type: row order[j] is scaled by weights[j] before it is
               summed (the product rounded, then added: numpy's bits for reduceat of the products)
   Every bound is checked before anything is written: a bad argument raises and leaves ``out``
   as it was. */

#include "kernels_c.h"

#include <string.h>

#define CHUNK 64      /* columns summed at a time: 8 partial sums and a half's sum per level stay in cache */
#define MAX_LEVELS 64 /* halvings of a run: a run of n rows needs under log2(n) */
#define BLOCK 128     /* numpy's PW_BLOCKSIZE */

/* numpy's pairwise sum of rows order[0..n), each scaled by its weight wt[i * ws] (ws 0: one
   weight, 1.0, for all: a product by one is exact), columns [c0, c0 + w), into res; scratch holds
   the 8 partial sums (8 * CHUNK) and each level's first half (MAX_LEVELS * CHUNK) */
#define PAIRWISE(T, NAME)                                                                                      \
    static void NAME(T *restrict res, const T *rows, const int64_t *order, const T *wt, Py_ssize_t ws,        \
                     Py_ssize_t n, Py_ssize_t cols, Py_ssize_t c0, Py_ssize_t w, T *scratch, int level) {     \
        if (n < 8) {                                                                                           \
            for (Py_ssize_t c = 0; c < w; c++)                                                                 \
                res[c] = (T)-0.0; /* addition's identity, as numpy 2 starts: -0.0 + x is x */            \
            for (Py_ssize_t i = 0; i < n; i++) {                                                               \
                const T *restrict src = rows + order[i] * cols + c0;                                           \
                T v = wt[i * ws];                                                                              \
                for (Py_ssize_t c = 0; c < w; c++)                                                             \
                    res[c] = res[c] + v * src[c];                                                              \
            }                                                                                                  \
        } else if (n <= BLOCK) {                                                                               \
            T *restrict r = scratch;                                                                           \
            for (int j = 0; j < 8; j++) {                                                                      \
                const T *restrict src = rows + order[j] * cols + c0;                                           \
                T v = wt[j * ws];                                                                              \
                for (Py_ssize_t c = 0; c < w; c++)                                                             \
                    r[j * CHUNK + c] = v * src[c];                                                             \
            }                                                                                                  \
            Py_ssize_t i = 8;                                                                                  \
            for (; i < n - (n % 8); i += 8)                                                                    \
                for (int j = 0; j < 8; j++) {                                                                  \
                    const T *restrict src = rows + order[i + j] * cols + c0;                                   \
                    T *restrict acc = r + j * CHUNK;                                                           \
                    T v = wt[(i + j) * ws];                                                                    \
                    for (Py_ssize_t c = 0; c < w; c++)                                                         \
                        acc[c] = acc[c] + v * src[c];                                                          \
                }                                                                                              \
            for (Py_ssize_t c = 0; c < w; c++) {                                                               \
                T a = r[c] + r[CHUNK + c], b = r[2 * CHUNK + c] + r[3 * CHUNK + c];                            \
                T d = r[4 * CHUNK + c] + r[5 * CHUNK + c], e = r[6 * CHUNK + c] + r[7 * CHUNK + c];            \
                a = a + b;                                                                                     \
                d = d + e;                                                                                     \
                res[c] = a + d;                                                                                \
            }                                                                                                  \
            for (; i < n; i++) {                                                                               \
                const T *restrict src = rows + order[i] * cols + c0;                                           \
                T v = wt[i * ws];                                                                              \
                for (Py_ssize_t c = 0; c < w; c++)                                                             \
                    res[c] = res[c] + v * src[c];                                                              \
            }                                                                                                  \
        } else {                                                                                               \
            Py_ssize_t n2 = n / 2;                                                                             \
            n2 -= n2 % 8;                                                                                      \
            T *left = scratch + (8 + level) * CHUNK;                                                           \
            NAME(left, rows, order, wt, ws, n2, cols, c0, w, scratch, level + 1);                              \
            NAME(res, rows, order + n2, wt + n2 * ws, ws, n - n2, cols, c0, w, scratch, level + 1);            \
            for (Py_ssize_t c = 0; c < w; c++)                                                                 \
                res[c] = left[c] + res[c];                                                                     \
        }                                                                                                      \
    }

/* each run: its first row (scaled), plus the pairwise sum of the rest (reduceat's order) */
#define SEGMENT_SUM(T, NAME, PW)                                                                              \
    PAIRWISE(T, PW)                                                                                           \
    static void NAME(T *restrict out, const T *rows, const int64_t *order, const int64_t *starts, Py_ssize_t n, \
                     Py_ssize_t u, Py_ssize_t cols, const T *wt, void *scratch) {                             \
        T rest[CHUNK];                                                                                        \
        static const T one = 1;                                                                               \
        Py_ssize_t ws = wt != NULL;                                                                           \
        if (wt == NULL)                                                                                       \
            wt = &one;                                                                                        \
        for (Py_ssize_t k = 0; k < u; k++) {                                                                  \
            Py_ssize_t s = (Py_ssize_t)starts[k], end = k + 1 < u ? (Py_ssize_t)starts[k + 1] : n;            \
            T *restrict dst = out + k * cols;                                                                 \
            const T *restrict first = rows + order[s] * cols;                                                 \
            T v = wt[s * ws];                                                                                 \
            for (Py_ssize_t c = 0; c < cols; c++)                                                             \
                dst[c] = v * first[c];                                                                        \
            if (end - s < 2)                                                                                  \
                continue;                                                                                     \
            for (Py_ssize_t c0 = 0; c0 < cols; c0 += CHUNK) {                                                 \
                Py_ssize_t w = cols - c0 < CHUNK ? cols - c0 : CHUNK;                                         \
                PW(rest, rows, order + s + 1, wt + (s + 1) * ws, ws, end - s - 1, cols, c0, w, scratch, 0);   \
                for (Py_ssize_t c = 0; c < w; c++)                                                            \
                    dst[c0 + c] = dst[c0 + c] + rest[c];                                                      \
            }                                                                                                 \
        }                                                                                                     \
    }
SEGMENT_SUM(float, segment_sum_f32, pairwise_f32)
SEGMENT_SUM(double, segment_sum_f64, pairwise_f64)

/* an int64 buffer's elements, or -1 with an exception set naming call ``fn`` and argument ``what`` */
static Py_ssize_t int64_count(const Py_buffer *b, const char *fn, const char *what) {
    const char *f = b->format ? b->format : "B";
    if (f[0] == '<' || f[0] == '=' || f[0] == '@')
        f++;
    if (!((f[0] == 'q' || (f[0] == 'l' && sizeof(long) == 8)) && f[1] == '\0') || b->itemsize != 8) {
        PyErr_Format(PyExc_TypeError, "%s: %s must be int64, got '%s'", fn, what, b->format ? b->format : "B");
        return -1;
    }
    if ((uintptr_t)b->buf % 8) {
        PyErr_Format(PyExc_ValueError, "%s: %s is not aligned to its type", fn, what);
        return -1;
    }
    return b->len / 8;
}

/* 0 where order (n row numbers, each below m) and starts describe runs, else -1 with ValueError set */
static int check_runs(const int64_t *order, Py_ssize_t n, Py_ssize_t m, const int64_t *starts, Py_ssize_t u) {
    for (Py_ssize_t i = 0; i < n; i++) {
        if (order[i] < 0 || order[i] >= m) {
            PyErr_Format(PyExc_ValueError, "segment_sum: order[%zd] = %lld is outside [0, %zd)", i,
                         (long long)order[i], m);
            return -1;
        }
    }
    if (u > 0 && starts[0] != 0) {
        PyErr_SetString(PyExc_ValueError, "segment_sum: starts[0] must be 0");
        return -1;
    }
    for (Py_ssize_t k = 0; k < u; k++) {
        if (starts[k] >= n || (k > 0 && starts[k] <= starts[k - 1])) {
            PyErr_Format(PyExc_ValueError,
                         "segment_sum: starts must increase strictly and stay below %zd; starts[%zd] = %lld", n, k,
                         (long long)starts[k]);
            return -1;
        }
    }
    return 0;
}

PyObject *zfk_segment_sum(PyObject *self, PyObject *args) {
    PyObject *o[2], *order_obj, *starts_obj, *weights_obj = Py_None;
    Py_ssize_t cols;
    if (!PyArg_ParseTuple(args, "OOOOn|O", &o[0], &o[1], &order_obj, &starts_obj, &cols, &weights_obj))
        return NULL;
    if (cols < 1) {
        PyErr_Format(PyExc_ValueError, "segment_sum: cols must be at least 1, got %zd", cols);
        return NULL;
    }
    Py_buffer ob[3]; /* out, rows: float; order, starts: int64 */
    int held = 0;
    PyObject *result = NULL;
    int flags[3] = {PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT,
                    PyBUF_C_CONTIGUOUS | PyBUF_FORMAT};
    PyObject *objs[3] = {o[0], o[1], order_obj};
    for (; held < 3; held++)
        if (PyObject_GetBuffer(objs[held], &ob[held], flags[held]) < 0)
            goto done;
    Py_buffer sb;
    if (PyObject_GetBuffer(starts_obj, &sb, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        goto done;
    char type = type_of(&ob[0]);
    Py_ssize_t item = type == 'f' ? (Py_ssize_t)sizeof(float) : (Py_ssize_t)sizeof(double);
    Py_ssize_t n = int64_count(&ob[2], "segment_sum", "order");
    Py_ssize_t u = n < 0 ? -1 : int64_count(&sb, "segment_sum", "starts");
    if (n < 0 || u < 0)
        goto release_starts;
    if (type == 0 || type_of(&ob[1]) != type) {
        PyErr_SetString(PyExc_TypeError, "segment_sum takes out and rows both float32 or both float64");
        goto release_starts;
    }
    if ((uintptr_t)ob[0].buf % item || (uintptr_t)ob[1].buf % item) {
        PyErr_SetString(PyExc_ValueError, "segment_sum: out and rows must be aligned to their type");
        goto release_starts;
    }
    Py_ssize_t m = ob[1].len / (cols * item); /* rows */
    if (ob[1].len != m * cols * item || ob[0].len != u * cols * item) {
        PyErr_Format(PyExc_ValueError,
                     "segment_sum: rows hold %zd bytes and out %zd, not whole rows of %zd and %zd such rows", ob[1].len,
                     ob[0].len, cols, u);
        goto release_starts;
    }
    if (ob[0].len && overlap(&ob[0], &ob[1])) {
        PyErr_SetString(PyExc_ValueError, "segment_sum: out and rows overlap");
        goto release_starts;
    }
    if (check_runs(ob[2].buf, n, m, sb.buf, u) < 0)
        goto release_starts;
    Py_buffer wb = {0};
    if (weights_obj != Py_None) {
        if (PyObject_GetBuffer(weights_obj, &wb, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
            goto release_starts;
        if (type_of(&wb) != type || (uintptr_t)wb.buf % item || wb.len != n * item) {
            PyErr_Format(PyExc_ValueError, "segment_sum: weights must be %zd aligned values of the rows' type", n);
            goto release_weights;
        }
    }
    void *scratch = PyMem_RawMalloc((8 + MAX_LEVELS) * CHUNK * sizeof(double));
    if (scratch == NULL) {
        PyErr_NoMemory();
        goto release_weights;
    }
    if (type == 'f')
        MAYBE_WITHOUT_GIL(n * cols,
                          segment_sum_f32(ob[0].buf, ob[1].buf, ob[2].buf, sb.buf, n, u, cols, wb.buf, scratch));
    else
        MAYBE_WITHOUT_GIL(n * cols,
                          segment_sum_f64(ob[0].buf, ob[1].buf, ob[2].buf, sb.buf, n, u, cols, wb.buf, scratch));
    PyMem_RawFree(scratch);
    Py_INCREF(Py_None);
    result = Py_None;
release_weights:
    if (wb.obj != NULL)
        PyBuffer_Release(&wb);
release_starts:
    PyBuffer_Release(&sb);
done:
    for (int i = 0; i < held; i++)
        PyBuffer_Release(&ob[i]);
    return result;
}

/* ---- grouping ids: the sort's work in two linear passes -------------------------------------

   first_seen(ids, seed, first, inverse) -> u
       ids: n int64. Writes the u distinct ids in order of first appearance into first[0..u), and
       for each id the index of its value there into inverse[i]. An open-addressing table of at
       least 2n slots, its hash keyed by ``seed`` (random per process: ids chosen to collide
       cannot be found without it). first, inverse: n int64 each, writable.
   runs(inverse, u, order, starts)
       inverse: n int64, each in [0, u). A stable counting sort: order (n int64) lists the
       positions of group 0, then group 1, ..., each group's in increasing order; starts (u int64)
       where each group begins in order. What segment_sum reads. */

static inline uint64_t mix_id(uint64_t x, uint64_t seed) {
    x ^= seed;
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    x ^= x >> 33;
    return x;
}

/* the int64 buffers of call ``fn``, writable from ``writable`` on, their lengths in ``lens``: 0,
   or -1 with an exception set and nothing held */
static int int64_buffers(Py_buffer *b, PyObject **objs, int n, int writable, const char *fn, const char **names,
                         Py_ssize_t *lens) {
    for (int i = 0; i < n; i++) {
        int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (i >= writable ? PyBUF_WRITABLE : 0);
        int held = PyObject_GetBuffer(objs[i], &b[i], flags) < 0 ? i : -1;
        if (held < 0 && (lens[i] = int64_count(&b[i], fn, names[i])) < 0)
            held = i + 1;
        if (held >= 0) {
            for (int j = 0; j < held; j++)
                PyBuffer_Release(&b[j]);
            return -1;
        }
    }
    return 0;
}

/* a call's arguments: an int64 array, a number, and two writable int64 arrays */
typedef struct {
    Py_buffer b[3];
    Py_ssize_t len[3];
    unsigned long long number;
} ArrayNumberTwoOut;

/* 0, or -1 with an exception set naming call ``fn`` (and the argument at fault) and nothing held */
static int array_number_two_out(PyObject *args, const char *fn, const char *n0, const char *n2, const char *n3,
                                ArrayNumberTwoOut *a) {
    PyObject *o[3];
    const char *names[3] = {n0, n2, n3};
    if (!PyArg_ParseTuple(args, "OKOO", &o[0], &a->number, &o[1], &o[2]))
        return -1;
    return int64_buffers(a->b, o, 3, 1, fn, names, a->len);
}

static void release_three(ArrayNumberTwoOut *a) {
    for (int i = 0; i < 3; i++)
        PyBuffer_Release(&a->b[i]);
}

/* the grouping itself, in a table of ``cap`` (a power of two) slots; returns the distinct ids */
static Py_ssize_t group_ids(const int64_t *ids, Py_ssize_t n, uint64_t seed, int64_t *keys, int64_t *slot, size_t cap,
                            int64_t *first, int64_t *inverse) {
    size_t mask = cap - 1;
    Py_ssize_t u = 0;
    for (size_t h = 0; h < cap; h++)
        slot[h] = -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t id = ids[i];
        size_t h = (size_t)mix_id((uint64_t)id, seed) & mask;
        while (slot[h] >= 0 && keys[h] != id)
            h = (h + 1) & mask;
        if (slot[h] < 0) {
            keys[h] = id;
            slot[h] = u;
            first[u++] = id;
        }
        inverse[i] = slot[h];
    }
    return u;
}

PyObject *zfk_first_seen(PyObject *self, PyObject *args) {
    ArrayNumberTwoOut a;
    if (array_number_two_out(args, "first_seen", "ids", "first", "inverse", &a) < 0)
        return NULL;
    Py_ssize_t n = a.len[0], u = 0;
    PyObject *result = NULL;
    if (a.len[1] < n || a.len[2] < n) {
        PyErr_Format(PyExc_ValueError, "first_seen: first and inverse must hold %zd ids each", n);
        goto done;
    }
    size_t cap = 16;
    while (cap < 2 * (size_t)n)
        cap <<= 1;
    int64_t *keys = PyMem_RawMalloc(cap * sizeof(int64_t)), *slot = PyMem_RawMalloc(cap * sizeof(int64_t));
    if (keys == NULL || slot == NULL) {
        PyMem_RawFree(keys);
        PyMem_RawFree(slot);
        PyErr_NoMemory();
        goto done;
    }
    MAYBE_WITHOUT_GIL(n, u = group_ids(a.b[0].buf, n, a.number, keys, slot, cap, a.b[1].buf, a.b[2].buf));
    PyMem_RawFree(keys);
    PyMem_RawFree(slot);
    result = PyLong_FromSsize_t(u);
done:
    release_three(&a);
    return result;
}

PyObject *zfk_runs(PyObject *self, PyObject *args) {
    ArrayNumberTwoOut a;
    if (array_number_two_out(args, "runs", "inverse", "order", "starts", &a) < 0)
        return NULL;
    const int64_t *inverse = a.b[0].buf;
    int64_t *order = a.b[1].buf, *starts = a.b[2].buf;
    Py_ssize_t n = a.len[0], u = a.number > (unsigned long long)PY_SSIZE_T_MAX ? -1 : (Py_ssize_t)a.number;
    PyObject *result = NULL;
    if (u < 0 || a.len[1] != n || a.len[2] != u) {
        PyErr_Format(PyExc_ValueError, "runs: order must hold %zd positions and starts %zd groups, not %zd and %zd",
                     n, u, a.len[1], a.len[2]);
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (inverse[i] < 0 || inverse[i] >= u) {
            PyErr_Format(PyExc_ValueError, "runs: inverse[%zd] = %lld is outside [0, %zd)", i, (long long)inverse[i],
                         u);
            goto done;
        }
    }
    memset(starts, 0, (size_t)u * sizeof(int64_t));
    for (Py_ssize_t i = 0; i < n; i++) /* counts */
        starts[inverse[i]]++;
    int64_t at = 0;
    for (Py_ssize_t k = 0; k < u; k++) { /* each group's first place */
        int64_t c = starts[k];
        starts[k] = at;
        at += c;
    }
    for (Py_ssize_t i = 0; i < n; i++) /* each group's places in turn: starts[k] ends at the next group's start */
        order[starts[inverse[i]]++] = i;
    for (Py_ssize_t k = u - 1; k > 0; k--)
        starts[k] = starts[k - 1];
    if (u > 0)
        starts[0] = 0;
    Py_INCREF(Py_None);
    result = Py_None;
done:
    release_three(&a);
    return result;
}
