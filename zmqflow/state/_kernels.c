/* Two memory-bound loops in C, each one pass where numpy makes two or stores through the cache.

   axpy: the optimizers' fused update, y += a * x in one pass over memory.

   numpy takes two: a temporary t = a * x (x read, t written), then y += t (y and t read, y
   written), so an SGD push moves each byte of its gradient about five times where one pass
   moves it three. A shard spends most of a dense push's CPU here. The result has the same bits
   as numpy's two steps: the product is rounded to the arrays' type, then the sum is; the build
   passes -ffp-contract=off, so no fused multiply-add can round once instead.
   Only the buffer protocol is used (no numpy headers), and the optimizers fall back to numpy
   where it was not built (zmqflow/state/kernels.py wraps both, with numpy's way as the fallback).

   copy: a pulled slice into the caller's array with non-temporal stores. A plain copy reads
   every destination line into the cache before overwriting it, a third memory pass the
   streaming stores skip; the lines then are not cached, which costs nothing for a model bigger
   than the cache. x86-64 only (SSE2, its baseline); elsewhere memcpy.

   axpy(y, x, a): y writable, x readable, both C-contiguous float32 ('f') or float64 ('d') of the
   same type and length, not overlapping; a a Python float, taken in the arrays' precision as numpy takes a weak
   scalar.
   copy(dst, src): dst writable, both C-contiguous, the same number of bytes, apart. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define RELEASE_GIL_FROM 65536 /* elements: below this the GIL's round trip costs more than it frees */

static void axpy_f32(float *restrict y, const float *restrict x, float a, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        float t = a * x[i];
        y[i] = y[i] + t;
    }
}

static void axpy_f64(double *restrict y, const double *restrict x, double a, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        double t = a * x[i];
        y[i] = y[i] + t;
    }
}

static char type_of(const Py_buffer *b) {
    const char *f = b->format ? b->format : "B";
    if (f[0] == '<' || f[0] == '=' || f[0] == '@')
        f++;
    return (f[0] == 'f' || f[0] == 'd') && f[1] == '\0' ? f[0] : 0;
}

static PyObject *kernels_axpy(PyObject *self, PyObject *args) {
    PyObject *yo, *xo;
    double a;
    if (!PyArg_ParseTuple(args, "OOd", &yo, &xo, &a))
        return NULL;
    Py_buffer y, x;
    if (PyObject_GetBuffer(yo, &y, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) < 0)
        return NULL;
    if (PyObject_GetBuffer(xo, &x, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(&y);
        return NULL;
    }
    PyObject *result = NULL;
    char t = type_of(&y);
    if (t == 0 || type_of(&x) != t) {
        PyErr_Format(PyExc_TypeError, "axpy takes two float32 or two float64 arrays, got '%s' and '%s'",
                     y.format ? y.format : "B", x.format ? x.format : "B");
        goto done;
    }
    if (x.len != y.len) {
        PyErr_Format(PyExc_ValueError, "axpy: y holds %zd bytes and x %zd", y.len, x.len);
        goto done;
    }
    if ((const char *)x.buf < (const char *)y.buf + y.len && (const char *)y.buf < (const char *)x.buf + x.len) {
        PyErr_SetString(PyExc_ValueError, "axpy: y and x overlap");
        goto done;
    }
    if (t == 'f') {
        Py_ssize_t n = y.len / (Py_ssize_t)sizeof(float);
        float af = (float)a;
        if (n >= RELEASE_GIL_FROM) {
            Py_BEGIN_ALLOW_THREADS
            axpy_f32((float *)y.buf, (const float *)x.buf, af, n);
            Py_END_ALLOW_THREADS
        } else {
            axpy_f32((float *)y.buf, (const float *)x.buf, af, n);
        }
    } else {
        Py_ssize_t n = y.len / (Py_ssize_t)sizeof(double);
        if (n >= RELEASE_GIL_FROM) {
            Py_BEGIN_ALLOW_THREADS
            axpy_f64((double *)y.buf, (const double *)x.buf, a, n);
            Py_END_ALLOW_THREADS
        } else {
            axpy_f64((double *)y.buf, (const double *)x.buf, a, n);
        }
    }
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&y);
    PyBuffer_Release(&x);
    return result;
}

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
    } else if ((const char *)src.buf < (const char *)dst.buf + dst.len && (const char *)dst.buf < (const char *)src.buf + src.len) {
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
    {"axpy", kernels_axpy, METH_VARARGS, "axpy(y, x, a): y += a * x, in place, one pass (float32 or float64)."},
    {"copy", kernels_copy, METH_VARARGS, "copy(dst, src): src's bytes into dst, with non-temporal stores."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels", "Memory-bound loops in C: the fused update, the streaming copy.", -1, methods};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&module); }
