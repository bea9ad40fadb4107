/* The optimizers' fused update in C: y += a * x in one pass over memory.

   numpy takes two: a temporary t = a * x (x read, t written), then y += t (y and t read, y
   written), so an SGD push moves each byte of its gradient about five times where one pass
   moves it three. A shard spends most of a dense push's CPU here. The result has the same bits
   as numpy's two steps: the product is rounded to the arrays' type, then the sum is; the build
   passes -ffp-contract=off, so no fused multiply-add can round once instead.
   Only the buffer protocol is used (no numpy headers), and the optimizers fall back to numpy
   where it was not built.

   axpy(y, x, a): y writable, x readable, both C-contiguous float32 ('f') or float64 ('d') of the
   same type and length, not overlapping; a a Python float, taken in the arrays' precision as numpy takes a weak
   scalar. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

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

static PyMethodDef methods[] = {
    {"axpy", kernels_axpy, METH_VARARGS, "axpy(y, x, a): y += a * x, in place, one pass (float32 or float64)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kernels", "The optimizers' fused update in C.", -1, methods};

PyMODINIT_FUNC PyInit_kernels(void) { return PyModule_Create(&module); }
