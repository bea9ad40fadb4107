/* The optimizers' updates over many parts in one call (the module is kernels_c.c's).

   A push of many small variables paid more for the Python around each part's update than for
   the update. axpy_many and adam_many take lists, item i's arrays the i-th of each, checked as
   the one-part calls check them; every item is checked before any is written, so a refusal
   leaves everything as it was. Items are applied in order: one item's arrays must be apart,
   two items' may not be (the later sees what the earlier wrote, as in a loop of one-part calls).

   axpy_many(ys, xs, a)                   ys[i] += a * xs[i]
   momentum_many(params, grads, ms, lr, mu, nesterov), adagrad_many(params, grads, accs, lr)
                                          kernels_c.c's momentum and adagrad on each item
   adam_many(params, grads, ms, vs, steps, table, c1, b1, c2, b2, eps, lr) -> [items left out]
       steps[i]: int64, one count a row of params[i] (rows = its length), each added one first;
       the row's step size is lr * table[count] in double, rounded to the arrays' type (the
       numpy side's lr * bias table, cast). An item with a count that would reach past the table
       is left as it was and named in the list returned: numpy's side computes those. */

#include "kernels_c.h"

static void release_many(Arrays *all, Py_ssize_t items) {
    for (Py_ssize_t i = 0; i < items; i++)
        zfk_release(&all[i]);
    PyMem_Free(all);
}

/* Every item's arrays from ``n`` lists of one length, the first ``writable`` written; NULL with
   an exception (nothing held) where a list or an item does not fit. */
static Arrays *acquire_many(const char *what, PyObject **lists, int n, int writable, Py_ssize_t *items) {
    Py_ssize_t count = PyList_GET_SIZE(lists[0]);
    for (int k = 1; k < n; k++) {
        if (PyList_GET_SIZE(lists[k]) != count) {
            PyErr_Format(PyExc_ValueError, "%s: list 0 holds %zd arrays and list %d %zd", what, count, k,
                         PyList_GET_SIZE(lists[k]));
            return NULL;
        }
    }
    Arrays *all = PyMem_Calloc(count ? (size_t)count : 1, sizeof(Arrays));
    if (all == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *objs[MAX_ARRAYS];
        for (int k = 0; k < n; k++)
            objs[k] = PyList_GET_ITEM(lists[k], i);
        if (zfk_acquire(&all[i], what, objs, n, writable) < 0) {
            release_many(all, i);
            return NULL;
        }
    }
    *items = count;
    return all;
}

PyObject *zfk_axpy_many(PyObject *self, PyObject *args) {
    PyObject *lists[2];
    double a;
    if (!PyArg_ParseTuple(args, "O!O!d", &PyList_Type, &lists[0], &PyList_Type, &lists[1], &a))
        return NULL;
    Py_ssize_t items;
    Arrays *all = acquire_many("axpy_many", lists, 2, 1, &items);
    if (all == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < items; i++) {
        Arrays *x = &all[i];
        Py_ssize_t n = x->count;
        if (x->type == 'f')
            MAYBE_WITHOUT_GIL(n, zfk_axpy_f32(x->b[0].buf, x->b[1].buf, (float)a, n));
        else
            MAYBE_WITHOUT_GIL(n, zfk_axpy_f64(x->b[0].buf, x->b[1].buf, a, n));
    }
    release_many(all, items);
    Py_RETURN_NONE;
}

/* the update of item ``x`` (param, state written; the gradient read) */
typedef void (*Step)(const Arrays *x, double lr, double mu, int nesterov);

static void momentum_item(const Arrays *x, double lr, double mu, int nesterov) {
    if (x->type == 'f')
        MAYBE_WITHOUT_GIL(x->count, zfk_momentum_f32(x->b[0].buf, x->b[2].buf, x->b[1].buf, (float)lr, (float)mu,
                                                     nesterov, x->count));
    else
        MAYBE_WITHOUT_GIL(x->count, zfk_momentum_f64(x->b[0].buf, x->b[2].buf, x->b[1].buf, lr, mu, nesterov,
                                                     x->count));
}

static void adagrad_item(const Arrays *x, double lr, double mu, int nesterov) {
    if (x->type == 'f')
        MAYBE_WITHOUT_GIL(x->count, zfk_adagrad_f32(x->b[0].buf, x->b[2].buf, x->b[1].buf, (float)lr, x->count));
    else
        MAYBE_WITHOUT_GIL(x->count, zfk_adagrad_f64(x->b[0].buf, x->b[2].buf, x->b[1].buf, lr, x->count));
}

/* params, grads and one state list: every item checked, then each updated by ``step`` */
static PyObject *with_state(const char *what, PyObject **lists, Step step, double lr, double mu, int nesterov) {
    PyObject *order[3] = {lists[0], lists[2], lists[1]}; /* param and its state written; the gradient read */
    Py_ssize_t items;
    Arrays *all = acquire_many(what, order, 3, 2, &items);
    if (all == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < items; i++)
        step(&all[i], lr, mu, nesterov);
    release_many(all, items);
    Py_RETURN_NONE;
}

PyObject *zfk_momentum_many(PyObject *self, PyObject *args) {
    PyObject *lists[3];
    double lr, mu;
    int nesterov;
    if (!PyArg_ParseTuple(args, "O!O!O!ddp", &PyList_Type, &lists[0], &PyList_Type, &lists[1], &PyList_Type,
                          &lists[2], &lr, &mu, &nesterov))
        return NULL;
    return with_state("momentum_many", lists, momentum_item, lr, mu, nesterov);
}

PyObject *zfk_adagrad_many(PyObject *self, PyObject *args) {
    PyObject *lists[3];
    double lr;
    if (!PyArg_ParseTuple(args, "O!O!O!d", &PyList_Type, &lists[0], &PyList_Type, &lists[1], &PyList_Type,
                          &lists[2], &lr))
        return NULL;
    return with_state("adagrad_many", lists, adagrad_item, lr, 0.0, 0);
}

/* Item ``i``'s step counts: int64, C-contiguous, writable, aligned, one a row of its arrays, apart
   from them: -1 with an exception where not. 1 where a count would reach ``limit`` (the table's
   length) once added one: the item is left to numpy's side. 0: the item is taken. */
static int check_steps(Py_buffer *s, const Arrays *x, Py_ssize_t i, Py_ssize_t limit) {
    const char *f = s->format ? s->format : "B";
    if (f[0] == '<' || f[0] == '=' || f[0] == '@')
        f++;
    if (s->itemsize != 8 || (f[0] != 'q' && f[0] != 'l') || f[1] != '\0') {
        PyErr_Format(PyExc_TypeError, "adam_many: steps %zd must be int64", i);
        return -1;
    }
    if ((uintptr_t)s->buf % 8) {
        PyErr_Format(PyExc_ValueError, "adam_many: steps %zd is not aligned to its type", i);
        return -1;
    }
    Py_ssize_t rows = s->len / 8;
    if (rows == 0 ? x->count != 0 : x->count % rows != 0) {
        PyErr_Format(PyExc_ValueError, "adam_many: item %zd's %zd elements do not make %zd rows", i, x->count, rows);
        return -1;
    }
    for (int k = 0; k < x->n; k++) {
        if (s->len && overlap(s, &x->b[k])) {
            PyErr_Format(PyExc_ValueError, "adam_many: steps %zd overlaps array %d of its item", i, k);
            return -1;
        }
    }
    const int64_t *t = s->buf;
    for (Py_ssize_t r = 0; r < rows; r++) {
        if (t[r] < 0) {
            PyErr_Format(PyExc_ValueError, "adam_many: item %zd row %zd has taken %lld steps", i, r, (long long)t[r]);
            return -1;
        }
        if (t[r] >= limit - 1)
            return 1;
    }
    return 0;
}

PyObject *zfk_adam_many(PyObject *self, PyObject *args) {
    PyObject *lists[5], *tableo;
    double c1, b1, c2, b2, eps, lr;
    if (!PyArg_ParseTuple(args, "O!O!O!O!O!Odddddd", &PyList_Type, &lists[0], &PyList_Type, &lists[1],
                          &PyList_Type, &lists[2], &PyList_Type, &lists[3], &PyList_Type, &lists[4], &tableo,
                          &c1, &b1, &c2, &b2, &eps, &lr))
        return NULL;
    if (PyList_GET_SIZE(lists[4]) != PyList_GET_SIZE(lists[0])) {
        PyErr_SetString(PyExc_ValueError, "adam_many: one steps array an item");
        return NULL;
    }
    Py_buffer table;
    if (PyObject_GetBuffer(tableo, &table, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return NULL;
    if (type_of(&table) != 'd' || (uintptr_t)table.buf % sizeof(double)) {
        PyErr_SetString(PyExc_TypeError, "adam_many: the table must be aligned float64");
        PyBuffer_Release(&table);
        return NULL;
    }
    PyObject *order[4] = {lists[0], lists[2], lists[3], lists[1]}; /* param, m, v written; the gradient read */
    Py_ssize_t items;
    Arrays *all = acquire_many("adam_many", order, 4, 3, &items);
    if (all == NULL) {
        PyBuffer_Release(&table);
        return NULL;
    }
    Py_buffer *steps = PyMem_Calloc(items ? (size_t)items : 1, sizeof(Py_buffer));
    char *past = PyMem_Calloc(items ? (size_t)items : 1, 1); /* items left to numpy's side */
    Py_ssize_t held = 0, most = 0;
    PyObject *result = NULL;
    void *rates = NULL;
    if (steps == NULL || past == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; held < items; held++) {
        int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE;
        if (PyObject_GetBuffer(PyList_GET_ITEM(lists[4], held), &steps[held], flags) < 0)
            goto done;
        int fit = check_steps(&steps[held], &all[held], held, table.len / (Py_ssize_t)sizeof(double));
        if (fit < 0) {
            held++;
            goto done;
        }
        past[held] = (char)fit;
        if (steps[held].len / 8 > most)
            most = steps[held].len / 8;
    }
    result = PyList_New(0);
    rates = PyMem_Malloc(most ? (size_t)most * sizeof(double) : 1); /* one item's step sizes at a time */
    if (result == NULL || rates == NULL) {
        Py_CLEAR(result);
        if (rates == NULL)
            PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < items; i++) { /* the items left out, named before any is written */
        PyObject *index = past[i] ? PyLong_FromSsize_t(i) : NULL;
        if (past[i] && (index == NULL || PyList_Append(result, index) < 0)) {
            Py_XDECREF(index);
            Py_CLEAR(result);
            goto done;
        }
        Py_XDECREF(index);
    }
    const double *bias = table.buf;
    for (Py_ssize_t i = 0; i < items; i++) {
        if (past[i])
            continue;
        Arrays *x = &all[i];
        int64_t *t = steps[i].buf;
        Py_ssize_t rows = steps[i].len / 8, cols = rows ? x->count / rows : 0;
        for (Py_ssize_t r = 0; r < rows; r++) {
            double rate = lr * bias[++t[r]];
            if (x->type == 'f')
                ((float *)rates)[r] = (float)rate;
            else
                ((double *)rates)[r] = rate;
        }
        if (x->type == 'f')
            MAYBE_WITHOUT_GIL(x->count, zfk_adam_f32(x->b[0].buf, x->b[3].buf, x->b[1].buf, x->b[2].buf, (float)c1,
                                                 (float)b1, (float)c2, (float)b2, (float)eps, rates, rows, cols));
        else
            MAYBE_WITHOUT_GIL(x->count, zfk_adam_f64(x->b[0].buf, x->b[3].buf, x->b[1].buf, x->b[2].buf, c1, b1, c2, b2,
                                                 eps, rates, rows, cols));
    }
done:
    PyMem_Free(rates);
    for (Py_ssize_t i = 0; i < held && steps != NULL; i++)
        PyBuffer_Release(&steps[i]);
    PyMem_Free(steps);
    PyMem_Free(past);
    release_many(all, items);
    PyBuffer_Release(&table);
    return result;
}
