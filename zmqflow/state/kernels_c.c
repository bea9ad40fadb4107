/* Memory-bound loops in C, each one pass where numpy makes several or stores through the cache.

   The optimizers' updates. numpy runs an update as a chain of whole-array steps, each a pass
   over memory with a temporary: SGD's param -= lr * grad is two passes, momentum's four or six,
   Adagrad's five, Adam's eleven. Here each is one pass: every element is read once, its chain run in registers, and
   written once. The results have numpy's bits: the same operations in the same order, each
   rounded to the arrays' type (sqrt and division are correctly rounded in both), and the build
   passes -ffp-contract=off so that no fused multiply-add rounds once where numpy rounds twice.
   NaN is the exception: a NaN result is NaN in both, but its sign and payload are unspecified
   (where two NaNs meet, which one an operation passes on depends on the order the compiler puts
   a commutative operation's operands in, and axpy adds a*x where numpy subtracts).
   Scalars come as Python floats and are taken in the arrays' precision, as numpy takes a weak
   scalar (NEP 50).

   copy: a pulled slice into the caller's array with non-temporal stores. A plain copy reads
   every destination line into the cache before overwriting it, a third memory pass the
   streaming stores skip; the lines then are not cached, which costs nothing for a model bigger
   than the cache. x86-64 only (SSE2, its baseline); elsewhere memcpy.

   Only the buffer protocol is used (no numpy headers). zmqflow/state/kernels.py wraps each
   function and does numpy's way where this module was not built or the arrays do not fit.

   axpy(y, x, a)                          y += a * x
   momentum(param, grad, m, lr, mu, nesterov)
                                          m = m*mu + g; param -= (nesterov ? m*mu + g : m) * lr
   adagrad(param, grad, acc, lr)          acc += g*g; param -= g / sqrt(acc) * lr
   adam(param, grad, m, v, c1, b1, c2, b2, eps, lr_rows)
                                          m = m*b1 + g*c1; v = v*b2 + g*g*c2;
                                          param -= m / (sqrt(v) + eps) * lr_rows[row]
       The float arrays: C-contiguous, aligned to their type, all float32 ('f') or all float64
       ('d'), the same length, none overlapping another; lr_rows: one value a row, of the same
       type (rows = its length), aligned.
   copy(dst, src)                         dst writable, both C-contiguous, the same bytes, apart.

   The same updates over many parts in one call (a push's): kernels_many.c. The sum of a sparse
   gradient's rows per id: kernels_rows.c. */

#include "kernels_c.h"

#include <math.h>
#include <string.h>

void zfk_release(Arrays *a) {
    for (int i = 0; i < a->n; i++)
        PyBuffer_Release(&a->b[i]);
    a->n = 0;
}

/* Acquire ``n`` float arrays, the first ``writable`` of them writable: one type, one length,
   apart. -1 with an exception set (and nothing held) when they are not. */
int zfk_acquire(Arrays *a, const char *what, PyObject **objs, int n, int writable) {
    a->n = 0;
    for (int i = 0; i < n; i++) {
        int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (i < writable ? PyBUF_WRITABLE : 0);
        if (PyObject_GetBuffer(objs[i], &a->b[i], flags) < 0) {
            zfk_release(a);
            return -1;
        }
        a->n++;
    }
    a->type = type_of(&a->b[0]);
    for (int i = 0; i < n; i++) {
        if (a->type == 0 || type_of(&a->b[i]) != a->type) {
            PyErr_Format(PyExc_TypeError, "%s takes float32 arrays or float64 arrays, all alike; array %d is '%s'",
                         what, i, a->b[i].format ? a->b[i].format : "B");
            zfk_release(a);
            return -1;
        }
        if ((uintptr_t)a->b[i].buf % (a->type == 'f' ? sizeof(float) : sizeof(double))) {
            PyErr_Format(PyExc_ValueError, "%s: array %d is not aligned to its type", what, i);
            zfk_release(a);
            return -1;
        }
        if (a->b[i].len != a->b[0].len) {
            PyErr_Format(PyExc_ValueError, "%s: array 0 holds %zd bytes and array %d %zd", what, a->b[0].len, i, a->b[i].len);
            zfk_release(a);
            return -1;
        }
        for (int j = 0; j < i; j++) {
            if (a->b[i].len && overlap(&a->b[i], &a->b[j])) {
                PyErr_Format(PyExc_ValueError, "%s: arrays %d and %d overlap", what, j, i);
                zfk_release(a);
                return -1;
            }
        }
    }
    a->count = a->b[0].len / (a->type == 'f' ? (Py_ssize_t)sizeof(float) : (Py_ssize_t)sizeof(double));
    return 0;
}

/* ---- axpy ---------------------------------------------------------------------------------- */

#define AXPY(T, NAME)                                                             \
    void NAME(T *restrict y, const T *restrict x, T a, Py_ssize_t n) {     \
        for (Py_ssize_t i = 0; i < n; i++) {                                      \
            T t = a * x[i];                                                       \
            y[i] = y[i] + t;                                                      \
        }                                                                         \
    }
AXPY(float, zfk_axpy_f32)
AXPY(double, zfk_axpy_f64)

static PyObject *kernels_axpy(PyObject *self, PyObject *args) {
    PyObject *o[2];
    double a;
    if (!PyArg_ParseTuple(args, "OOd", &o[0], &o[1], &a))
        return NULL;
    Arrays arr;
    if (zfk_acquire(&arr, "axpy", o, 2, 1) < 0)
        return NULL;
    Py_ssize_t n = arr.count;
    if (arr.type == 'f')
        MAYBE_WITHOUT_GIL(n, zfk_axpy_f32(arr.b[0].buf, arr.b[1].buf, (float)a, n));
    else
        MAYBE_WITHOUT_GIL(n, zfk_axpy_f64(arr.b[0].buf, arr.b[1].buf, a, n));
    zfk_release(&arr);
    Py_RETURN_NONE;
}

/* ---- momentum ------------------------------------------------------------------------------ */

#define MOMENTUM(T, NAME)                                                                                \
    void NAME(T *restrict p, const T *restrict g, T *restrict m, T lr, T mu, int nesterov, Py_ssize_t n) { \
        for (Py_ssize_t i = 0; i < n; i++) {                                                             \
            T gi = g[i];                                                                                 \
            T mi = m[i] * mu;                                                                            \
            mi = mi + gi;                                                                                \
            m[i] = mi;                                                                                   \
            T d = mi;                                                                                    \
            if (nesterov) {                                                                              \
                d = mi * mu;                                                                             \
                d = d + gi;                                                                              \
            }                                                                                            \
            d = d * lr;                                                                                  \
            p[i] = p[i] - d;                                                                             \
        }                                                                                                \
    }
MOMENTUM(float, zfk_momentum_f32)
MOMENTUM(double, zfk_momentum_f64)

static PyObject *kernels_momentum(PyObject *self, PyObject *args) {
    PyObject *o[3];
    double lr, mu;
    int nesterov;
    if (!PyArg_ParseTuple(args, "OOOddp", &o[0], &o[1], &o[2], &lr, &mu, &nesterov))
        return NULL;
    Arrays arr;
    PyObject *order[3] = {o[0], o[2], o[1]}; /* param and m written; the gradient read */
    if (zfk_acquire(&arr, "momentum", order, 3, 2) < 0)
        return NULL;
    Py_ssize_t n = arr.count;
    if (arr.type == 'f')
        MAYBE_WITHOUT_GIL(n, zfk_momentum_f32(arr.b[0].buf, arr.b[2].buf, arr.b[1].buf, (float)lr, (float)mu,
                                              nesterov, n));
    else
        MAYBE_WITHOUT_GIL(n, zfk_momentum_f64(arr.b[0].buf, arr.b[2].buf, arr.b[1].buf, lr, mu, nesterov, n));
    zfk_release(&arr);
    Py_RETURN_NONE;
}

/* ---- adagrad ------------------------------------------------------------------------------- */

#define ADAGRAD(T, SQRT, NAME)                                                                  \
    void NAME(T *restrict p, const T *restrict g, T *restrict acc, T lr, Py_ssize_t n) { \
        for (Py_ssize_t i = 0; i < n; i++) {                                                    \
            T gi = g[i];                                                                        \
            T sq = gi * gi;                                                                     \
            T a = acc[i] + sq;                                                                  \
            acc[i] = a;                                                                         \
            T d = SQRT(a);                                                                      \
            d = gi / d;                                                                         \
            d = d * lr;                                                                         \
            p[i] = p[i] - d;                                                                    \
        }                                                                                       \
    }
ADAGRAD(float, sqrtf, zfk_adagrad_f32)
ADAGRAD(double, sqrt, zfk_adagrad_f64)

static PyObject *kernels_adagrad(PyObject *self, PyObject *args) {
    PyObject *o[3];
    double lr;
    if (!PyArg_ParseTuple(args, "OOOd", &o[0], &o[1], &o[2], &lr))
        return NULL;
    Arrays arr;
    /* param and acc are written: acquire them first (writable), then the gradient */
    PyObject *order[3] = {o[0], o[2], o[1]};
    if (zfk_acquire(&arr, "adagrad", order, 3, 2) < 0)
        return NULL;
    Py_ssize_t n = arr.count;
    if (arr.type == 'f')
        MAYBE_WITHOUT_GIL(n, zfk_adagrad_f32(arr.b[0].buf, arr.b[2].buf, arr.b[1].buf, (float)lr, n));
    else
        MAYBE_WITHOUT_GIL(n, zfk_adagrad_f64(arr.b[0].buf, arr.b[2].buf, arr.b[1].buf, lr, n));
    zfk_release(&arr);
    Py_RETURN_NONE;
}

/* ---- adam ---------------------------------------------------------------------------------- */

#define ADAM(T, SQRT, NAME)                                                                        \
    void NAME(T *restrict p, const T *restrict g, T *restrict m, T *restrict v, T c1, T b1, \
                     T c2, T b2, T eps, const T *restrict lr, Py_ssize_t rows, Py_ssize_t cols) {  \
        for (Py_ssize_t r = 0; r < rows; r++) {                                                    \
            T lr_r = lr[r];                                                                        \
            Py_ssize_t base = r * cols;                                                            \
            for (Py_ssize_t c = 0; c < cols; c++) {                                                \
                Py_ssize_t i = base + c;                                                           \
                T gi = g[i];                                                                       \
                T t1 = gi * c1;                                                                    \
                T mi = m[i] * b1;                                                                  \
                mi = mi + t1;                                                                      \
                m[i] = mi;                                                                         \
                T t2 = gi * gi;                                                                    \
                t2 = t2 * c2;                                                                      \
                T vi = v[i] * b2;                                                                  \
                vi = vi + t2;                                                                      \
                v[i] = vi;                                                                         \
                T d = SQRT(vi);                                                                    \
                d = d + eps;                                                                       \
                d = mi / d;                                                                        \
                d = d * lr_r;                                                                      \
                p[i] = p[i] - d;                                                                   \
            }                                                                                      \
        }                                                                                          \
    }
ADAM(float, sqrtf, zfk_adam_f32)
ADAM(double, sqrt, zfk_adam_f64)

static PyObject *kernels_adam(PyObject *self, PyObject *args) {
    PyObject *o[4], *lro;
    double c1, b1, c2, b2, eps;
    if (!PyArg_ParseTuple(args, "OOOOdddddO", &o[0], &o[1], &o[2], &o[3], &c1, &b1, &c2, &b2, &eps, &lro))
        return NULL;
    Arrays arr;
    PyObject *order[4] = {o[0], o[2], o[3], o[1]}; /* param, m, v written; the gradient read */
    if (zfk_acquire(&arr, "adam", order, 4, 3) < 0)
        return NULL;
    Py_buffer lr;
    if (PyObject_GetBuffer(lro, &lr, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        zfk_release(&arr);
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t item = arr.type == 'f' ? (Py_ssize_t)sizeof(float) : (Py_ssize_t)sizeof(double);
    Py_ssize_t rows = lr.len / item, n = arr.count;
    if (type_of(&lr) != arr.type) {
        PyErr_SetString(PyExc_TypeError, "adam: lr_rows must be of the arrays' type");
    } else if ((uintptr_t)lr.buf % item) {
        PyErr_SetString(PyExc_ValueError, "adam: lr_rows is not aligned to its type");
    } else if (rows == 0 ? n != 0 : n % rows != 0) {
        PyErr_Format(PyExc_ValueError, "adam: %zd elements do not make %zd rows", n, rows);
    } else {
        Py_ssize_t cols = rows ? n / rows : 0;
        if (arr.type == 'f')
            MAYBE_WITHOUT_GIL(n, zfk_adam_f32(arr.b[0].buf, arr.b[3].buf, arr.b[1].buf, arr.b[2].buf, (float)c1,
                                              (float)b1, (float)c2, (float)b2, (float)eps, lr.buf, rows, cols));
        else
            MAYBE_WITHOUT_GIL(n, zfk_adam_f64(arr.b[0].buf, arr.b[3].buf, arr.b[1].buf, arr.b[2].buf, c1, b1, c2,
                                              b2, eps, lr.buf, rows, cols));
        result = Py_None;
        Py_INCREF(result);
    }
    PyBuffer_Release(&lr);
    zfk_release(&arr);
    return result;
}

/* ---- copy ---------------------------------------------------------------------------------- */

static void copy_streaming(char *dst, const char *src, Py_ssize_t n) {
#if defined(__SSE2__)
    Py_ssize_t i = 0;
    while (i < n && ((uintptr_t)(dst + i) & 15))
        i++;
    memcpy(dst, src, (size_t)i); /* up to the destination's first 16-byte boundary */
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    memcpy(dst + i, src + i, (size_t)(n - i));
    _mm_sfence(); /* the streamed stores are visible before the call returns */
#else
    memcpy(dst, src, (size_t)n);
#endif
}

static PyObject *kernels_copy(PyObject *self, PyObject *args) {
    PyObject *dsto, *srco;
    if (!PyArg_ParseTuple(args, "OO", &dsto, &srco))
        return NULL;
    Py_buffer dst, src;
    if (PyObject_GetBuffer(dsto, &dst, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0)
        return NULL;
    if (PyObject_GetBuffer(srco, &src, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&dst);
        return NULL;
    }
    PyObject *result = NULL;
    if (dst.len != src.len) {
        PyErr_Format(PyExc_ValueError, "copy: dst holds %zd bytes and src %zd", dst.len, src.len);
    } else if (overlap(&dst, &src)) {
        PyErr_SetString(PyExc_ValueError, "copy: dst and src overlap");
    } else {
        Py_BEGIN_ALLOW_THREADS
        copy_streaming((char *)dst.buf, (const char *)src.buf, dst.len);
        Py_END_ALLOW_THREADS
        result = Py_None;
        Py_INCREF(result);
    }
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return result;
}

static PyMethodDef methods[] = {
    {"axpy", kernels_axpy, METH_VARARGS, "axpy(y, x, a): y += a * x, in place, one pass."},
    {"momentum", kernels_momentum, METH_VARARGS, "momentum(param, grad, m, lr, mu, nesterov): momentum's step, in place, one pass."},
    {"adagrad", kernels_adagrad, METH_VARARGS, "adagrad(param, grad, acc, lr): Adagrad's step, in place, one pass."},
    {"adam", kernels_adam, METH_VARARGS, "adam(param, grad, m, v, c1, b1, c2, b2, eps, lr_rows): Adam's step, in place, one pass."},
    {"axpy_many", zfk_axpy_many, METH_VARARGS, "axpy_many(ys, xs, a): axpy on each item, every item checked first."},
    {"momentum_many", zfk_momentum_many, METH_VARARGS,
     "momentum_many(params, grads, ms, lr, mu, nesterov): momentum on each item, every item checked first."},
    {"adagrad_many", zfk_adagrad_many, METH_VARARGS,
     "adagrad_many(params, grads, accs, lr): Adagrad on each item, every item checked first."},
    {"adam_many", zfk_adam_many, METH_VARARGS,
     "adam_many(params, grads, ms, vs, steps, table, c1, b1, c2, b2, eps, lr): Adam on each item, its rows' counts "
     "stepped and their step sizes looked up, every item checked first."},
    {"segment_sum", zfk_segment_sum, METH_VARARGS,
     "segment_sum(out, rows, order, starts, cols, weights=None): each run's rows, read through order (each scaled by "
     "its weight), summed into its row of out."},
    {"first_seen", zfk_first_seen, METH_VARARGS,
     "first_seen(ids, seed, first, inverse) -> u: the distinct ids in order of first appearance, and each id's "
     "index there."},
    {"runs", zfk_runs, METH_VARARGS,
     "runs(inverse, u, order, starts): a stable counting sort of the positions by group."},
    {"copy", kernels_copy, METH_VARARGS, "copy(dst, src): src's bytes into dst, with non-temporal stores."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kernels_c",
                                    "Memory-bound loops in C: the optimizers' updates, the streaming copy, the sparse "
                                    "rows' sums and the ids' grouping.",
                                    -1, methods};

PyMODINIT_FUNC PyInit_kernels_c(void) { return PyModule_Create(&module); }
