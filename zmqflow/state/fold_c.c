/* The ring's fold in C: one pass where numpy makes one per rank.

   fold(out, views, div, stream)          out = (((v0 + v1) + v2) + ...) / div (no division when div is 0)
       The shared-memory ring reduces one piece of every rank at a time, in rank order. numpy
       runs np.add once per view, each call a pass that writes out (and, out being cold, first
       reads it into the cache); here every element is summed in registers and written once, with
       non-temporal stores when ``stream`` is set (a result bigger than the cache is not read back
       before it is whole). The bits are numpy's: the same additions in the same order, then the
       same division, each rounded to the arrays' type (vector lanes round as scalars do; the
       build passes -ffp-contract=off). NaN is the exception: a NaN result is NaN in both, but its
       sign and payload are unspecified (where two NaNs meet, which one an addition passes on
       depends on the order the compiler puts its operands in, which may differ between the
       scalar and the vector loop). out writable; out and views all float32 or all float64,
       aligned to their type, of one length; out apart from every view (views may alias one
       another: they are only read).
       On x86-64 the vector loop is SSE2's, or AVX's where the CPU has it (checked at run time, so
       the build runs on any x86-64).
   _avx(on)                               the AVX loop on (where the CPU has it) or off; returns
                                          the previous setting, so tests run both loops.

   zmqflow/state/kernels.py wraps it (fold_sum) and leaves numpy to fold whatever it does not take. */

#include "kernels_common.h"

#define MAX_FOLD 64

/* element i of out: the views summed in order, then divided (each step rounded to T, as numpy) */
#define FOLD_AT(T, i)                                                                               \
    do {                                                                                            \
        T s_ = v[0][i] + v[1][i];                                                                   \
        for (int j_ = 2; j_ < k; j_++)                                                              \
            s_ = s_ + v[j_][i];                                                                     \
        out[i] = div ? s_ / d : s_;                                                                 \
    } while (0)

/* From element i: scalars up to out's next W-byte boundary, then whole vectors of W bytes with
   aligned (or streaming) stores, four at a time while four fit (four loads in flight per view
   keep the memory busy: one at a time was slower than numpy's own loop), then one at a time;
   returns where the vectors stopped. Every lane rounds as the scalar operation does. ATTR lets
   one build carry a loop for an instruction set that only some CPUs have. */
#define FOLD_VECTORS(NAME, ATTR, T, V, W, LOAD, ADD, DIV, SET1, STREAM, STORE)                       \
    ATTR static Py_ssize_t NAME(T *out, const T **v, int k, T d, int div, int stream, Py_ssize_t i, \
                                Py_ssize_t n) {                                                     \
        for (; i < n && ((uintptr_t)(out + i) & (W - 1)); i++)                                      \
            FOLD_AT(T, i);                                                                          \
        const Py_ssize_t w = W / (Py_ssize_t)sizeof(T);                                             \
        V dv = SET1(d);                                                                             \
        for (; i + 4 * w <= n; i += 4 * w) {                                                        \
            V s0 = ADD(LOAD(v[0] + i), LOAD(v[1] + i));                                             \
            V s1 = ADD(LOAD(v[0] + i + w), LOAD(v[1] + i + w));                                     \
            V s2 = ADD(LOAD(v[0] + i + 2 * w), LOAD(v[1] + i + 2 * w));                             \
            V s3 = ADD(LOAD(v[0] + i + 3 * w), LOAD(v[1] + i + 3 * w));                             \
            for (int j = 2; j < k; j++) {                                                           \
                s0 = ADD(s0, LOAD(v[j] + i));                                                       \
                s1 = ADD(s1, LOAD(v[j] + i + w));                                                   \
                s2 = ADD(s2, LOAD(v[j] + i + 2 * w));                                               \
                s3 = ADD(s3, LOAD(v[j] + i + 3 * w));                                               \
            }                                                                                       \
            if (div) {                                                                              \
                s0 = DIV(s0, dv); s1 = DIV(s1, dv); s2 = DIV(s2, dv); s3 = DIV(s3, dv);             \
            }                                                                                       \
            if (stream) {                                                                           \
                STREAM(out + i, s0); STREAM(out + i + w, s1);                                       \
                STREAM(out + i + 2 * w, s2); STREAM(out + i + 3 * w, s3);                           \
            } else {                                                                                \
                STORE(out + i, s0); STORE(out + i + w, s1);                                         \
                STORE(out + i + 2 * w, s2); STORE(out + i + 3 * w, s3);                             \
            }                                                                                       \
        }                                                                                           \
        for (; i + w <= n; i += w) {                                                                \
            V s = ADD(LOAD(v[0] + i), LOAD(v[1] + i));                                              \
            for (int j = 2; j < k; j++)                                                             \
                s = ADD(s, LOAD(v[j] + i));                                                         \
            if (div)                                                                                \
                s = DIV(s, dv);                                                                     \
            if (stream)                                                                             \
                STREAM(out + i, s);                                                                 \
            else                                                                                    \
                STORE(out + i, s);                                                                  \
        }                                                                                           \
        return i;                                                                                   \
    }

#if defined(__SSE2__) /* x86-64's baseline: every such CPU runs these */
FOLD_VECTORS(vec_float, , float, __m128, 16, _mm_loadu_ps, _mm_add_ps, _mm_div_ps, _mm_set1_ps, _mm_stream_ps,
             _mm_store_ps)
FOLD_VECTORS(vec_double, , double, __m128d, 16, _mm_loadu_pd, _mm_add_pd, _mm_div_pd, _mm_set1_pd, _mm_stream_pd,
             _mm_store_pd)
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HAVE_AVX_FOLD 1
#define AVX __attribute__((target("avx")))
FOLD_VECTORS(avx_float, AVX, float, __m256, 32, _mm256_loadu_ps, _mm256_add_ps, _mm256_div_ps, _mm256_set1_ps,
             _mm256_stream_ps, _mm256_store_ps)
FOLD_VECTORS(avx_double, AVX, double, __m256d, 32, _mm256_loadu_pd, _mm256_add_pd, _mm256_div_pd, _mm256_set1_pd,
             _mm256_stream_pd, _mm256_store_pd)
static int has_avx = -1; /* asked of the CPU on the first fold: the build itself runs on any x86-64 */
static int avx_on(void) {
    if (has_avx < 0)
        has_avx = __builtin_cpu_supports("avx") ? 1 : 0;
    return has_avx;
}
#define VECTORS(T) (has_avx ? avx_##T : vec_##T)
#else
#define VECTORS(T) vec_##T
#endif
#endif

#define FOLD(T)                                                                                     \
    static void fold_##T(T *out, const T **v, int k, T d, int div, int stream, Py_ssize_t n) {     \
        Py_ssize_t i = 0;                                                                           \
        FOLD_VECTORS_OF(T);                                                                         \
        for (; i < n; i++)                                                                          \
            FOLD_AT(T, i);                                                                          \
    }
#if defined(__SSE2__)
#define FOLD_VECTORS_OF(T)                                                                          \
    i = VECTORS(T)(out, v, k, d, div, stream, i, n);                                                \
    if (stream)                                                                                     \
        _mm_sfence() /* the streamed stores are visible before the call returns */
#else
#define FOLD_VECTORS_OF(T) (void)stream
#endif
FOLD(float)
FOLD(double)

static PyObject *fold(PyObject *self, PyObject *args) {
    PyObject *outo, *seq;
    Py_ssize_t div;
    int stream;
    if (!PyArg_ParseTuple(args, "OOnp", &outo, &seq, &div, &stream))
        return NULL;
    if (div < 0) {
        PyErr_SetString(PyExc_ValueError, "fold: div must be >= 0");
        return NULL;
    }
#if defined(HAVE_AVX_FOLD)
    avx_on(); /* asked once, under the GIL, before a loop may run without it */
#endif
    PyObject *views = PySequence_Fast(seq, "fold: views must be a sequence of arrays");
    if (views == NULL)
        return NULL;
    Py_ssize_t k = PySequence_Fast_GET_SIZE(views);
    if (k < 2 || k > MAX_FOLD) {
        PyErr_Format(PyExc_ValueError, "fold takes 2 to %d views, got %zd", MAX_FOLD, k);
        Py_DECREF(views);
        return NULL;
    }
    Py_buffer b[MAX_FOLD + 1];
    int held = 0;
    PyObject *result = NULL;
    if (PyObject_GetBuffer(outo, &b[0], PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) < 0)
        goto done;
    held = 1;
    char type = type_of(&b[0]);
    for (Py_ssize_t j = 0; j < k; j++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(views, j), &b[held], PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
            goto done;
        held++;
        uintptr_t item = type == 'f' ? sizeof(float) : sizeof(double);
        if (type == 0 || type_of(&b[held - 1]) != type) {
            PyErr_Format(PyExc_TypeError, "fold takes float32 arrays or float64 arrays, all alike; out is '%s' and "
                         "view %zd '%s'", b[0].format ? b[0].format : "B", j,
                         b[held - 1].format ? b[held - 1].format : "B");
            goto done;
        }
        if ((uintptr_t)b[0].buf % item || (uintptr_t)b[held - 1].buf % item) {
            if ((uintptr_t)b[0].buf % item)
                PyErr_SetString(PyExc_ValueError, "fold: out is not aligned to its type");
            else
                PyErr_Format(PyExc_ValueError, "fold: view %zd is not aligned to its type", j);
            goto done;
        }
        if (b[held - 1].len != b[0].len) {
            PyErr_Format(PyExc_ValueError, "fold: out holds %zd bytes and view %zd %zd", b[0].len, j, b[held - 1].len);
            goto done;
        }
        if (b[0].len && overlap(&b[0], &b[held - 1])) {
            PyErr_Format(PyExc_ValueError, "fold: out and view %zd overlap", j);
            goto done;
        }
    }
    {
        const void *src[MAX_FOLD];
        for (Py_ssize_t j = 0; j < k; j++)
            src[j] = b[j + 1].buf;
        if (type == 'f') {
            Py_ssize_t n = b[0].len / (Py_ssize_t)sizeof(float);
            MAYBE_WITHOUT_GIL(n, fold_float((float *)b[0].buf, (const float **)src, (int)k, (float)div, div > 0,
                                            stream, n));
        } else {
            Py_ssize_t n = b[0].len / (Py_ssize_t)sizeof(double);
            MAYBE_WITHOUT_GIL(n, fold_double((double *)b[0].buf, (const double **)src, (int)k, (double)div, div > 0,
                                             stream, n));
        }
    }
    result = Py_None;
    Py_INCREF(result);
done:
    for (int j = 0; j < held; j++)
        PyBuffer_Release(&b[j]);
    Py_DECREF(views);
    return result;
}

/* _avx(on): the fold's AVX loop on (where the CPU has it) or off; returns whether it was on. For
   the tests, which run the 16-byte loop where the CPU would pick the 32-byte one. */
static PyObject *avx(PyObject *self, PyObject *arg) {
    int on = PyObject_IsTrue(arg);
    if (on < 0)
        return NULL;
#if defined(HAVE_AVX_FOLD)
    int before = avx_on();
    has_avx = on && __builtin_cpu_supports("avx") ? 1 : 0;
    return PyBool_FromLong(before);
#else
    return PyBool_FromLong(0);
#endif
}

static PyMethodDef methods[] = {
    {"fold", fold, METH_VARARGS, "fold(out, views, div, stream): out = sum of views in order (divided by div unless 0), one pass."},
    {"_avx", avx, METH_O, "_avx(on): the fold's AVX loop on or off (where the CPU has it); returns the previous setting."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "fold_c", "The ring's fold in C: one pass where numpy makes one per rank.", -1, methods};

PyMODINIT_FUNC PyInit_fold_c(void) { return PyModule_Create(&module); }
