/* What kernels_c.c (the one-part updates, the module) and kernels_many.c (the same updates over
   many parts in one call) share: the checked arrays of a call and the element loops. */

#ifndef ZMQFLOW_KERNELS_C_H
#define ZMQFLOW_KERNELS_C_H

#include "kernels_common.h"

#define MAX_ARRAYS 5

/* the arrays of one call: acquired and checked together, released together */
typedef struct {
    Py_buffer b[MAX_ARRAYS];
    int n;
    char type; /* 'f' or 'd' */
    Py_ssize_t count; /* elements of each */
} Arrays;

void zfk_release(Arrays *a);
/* ``n`` float arrays, the first ``writable`` writable: one type, one length, apart; -1 with an
   exception set (and nothing held) when they are not */
int zfk_acquire(Arrays *a, const char *what, PyObject **objs, int n, int writable);

void zfk_axpy_f32(float *restrict y, const float *restrict x, float a, Py_ssize_t n);
void zfk_axpy_f64(double *restrict y, const double *restrict x, double a, Py_ssize_t n);
void zfk_momentum_f32(float *restrict p, const float *restrict g, float *restrict m, float lr, float mu, int nesterov,
                      Py_ssize_t n);
void zfk_momentum_f64(double *restrict p, const double *restrict g, double *restrict m, double lr, double mu,
                      int nesterov, Py_ssize_t n);
void zfk_adagrad_f32(float *restrict p, const float *restrict g, float *restrict acc, float lr, Py_ssize_t n);
void zfk_adagrad_f64(double *restrict p, const double *restrict g, double *restrict acc, double lr, Py_ssize_t n);
void zfk_adam_f32(float *restrict p, const float *restrict g, float *restrict m, float *restrict v, float c1, float b1,
                  float c2, float b2, float eps, const float *restrict lr, Py_ssize_t rows, Py_ssize_t cols);
void zfk_adam_f64(double *restrict p, const double *restrict g, double *restrict m, double *restrict v, double c1,
                  double b1, double c2, double b2, double eps, const double *restrict lr, Py_ssize_t rows,
                  Py_ssize_t cols);

/* kernels_many.c */
PyObject *zfk_axpy_many(PyObject *self, PyObject *args);
PyObject *zfk_momentum_many(PyObject *self, PyObject *args);
PyObject *zfk_adagrad_many(PyObject *self, PyObject *args);
PyObject *zfk_adam_many(PyObject *self, PyObject *args);

/* kernels_rows.c */
PyObject *zfk_segment_sum(PyObject *self, PyObject *args);
PyObject *zfk_first_seen(PyObject *self, PyObject *args);
PyObject *zfk_runs(PyObject *self, PyObject *args);

#endif
