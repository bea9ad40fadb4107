/* The hash index's two inner loops (find and place) in C, over the same memory as hash_index.py.

   numpy runs each probe step as a pass over the whole batch: about 30 passes of 4096 elements
   per lookup, and a gather (a cache miss an id) in several of them. Here each id walks its probe
   sequence once, with the control word and the handles of an id 16 places ahead prefetched, so
   the misses of many ids overlap. The layout, the hash and the probe sequence are hash_index.py's
   (its docstring is the reference); only the buffer protocol is used, so the module needs no
   numpy headers to build, and the index falls back to numpy where it was not built.

   find(ctrl, handles, keys, ids, out_handle, out_bucket_or_None, groups)
   place(ctrl, handles, ids, handles_in, groups) -> buckets taken that were EMPTY */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define GROUP 8
#define EMPTY 0x00
#define DELETED 0x01
#define GOLDEN 0x9E3779B97F4A7C15ULL
#define AHEAD 16

#if defined(__GNUC__) || defined(__clang__)
#define PREFETCH(p) __builtin_prefetch((p))
#else
#define PREFETCH(p) ((void)0)
#endif

typedef struct {
    const uint8_t *ctrl;
    void *handles;
    int wide;          /* handles are int64 (else int32) */
    uint64_t groups;   /* any number from 1 to 2**32 */
} Index;

static inline int64_t handle_at(const Index *ix, uint64_t bucket) {
    return ix->wide ? ((const int64_t *)ix->handles)[bucket] : (int64_t)((const int32_t *)ix->handles)[bucket];
}

static inline void hash_of(const Index *ix, int64_t id, uint64_t *group, uint8_t *fp) {
    uint64_t h = (uint64_t)id * GOLDEN;
    *fp = (uint8_t)(((h >> 25) & 0x7F) | 0x80);
    *group = ((h >> 32) * ix->groups) >> 32;
}

static inline void prefetch_home(const Index *ix, int64_t id) {
    uint64_t g;
    uint8_t fp;
    hash_of(ix, id, &g, &fp);
    PREFETCH(ix->ctrl + g * GROUP);
    PREFETCH((const char *)ix->handles + g * GROUP * (ix->wide ? 8 : 4));
}

static int index_from(Index *ix, Py_buffer *ctrl, Py_buffer *handles, unsigned long long groups) {
    if (groups < 1 || groups > ((unsigned long long)1 << 32) || (unsigned long long)ctrl->len != GROUP * groups) {
        PyErr_Format(PyExc_ValueError, "control bytes (%zd) do not match %llu groups", ctrl->len, groups);
        return -1;
    }
    if (handles->itemsize != 4 && handles->itemsize != 8) {
        PyErr_SetString(PyExc_ValueError, "handles must be int32 or int64");
        return -1;
    }
    if (handles->len != ctrl->len * handles->itemsize) {
        PyErr_SetString(PyExc_ValueError, "one handle per control byte");
        return -1;
    }
    ix->ctrl = (const uint8_t *)ctrl->buf;
    ix->handles = handles->buf;
    ix->wide = handles->itemsize == 8;
    ix->groups = (uint64_t)groups;
    return 0;
}

static int check_i64(Py_buffer *b, const char *what, Py_ssize_t n) {
    if (b->itemsize != 8 || (n >= 0 && b->len != n * 8)) {
        PyErr_Format(PyExc_ValueError, "%s must hold %zd int64 values", what, n);
        return -1;
    }
    return 0;
}

static PyObject *probe_find(PyObject *self, PyObject *args) {
    Py_buffer ctrl, handles, keys, ids, out, bucket = {0};
    PyObject *bucket_obj;
    unsigned long long groups;
    if (!PyArg_ParseTuple(args, "y*y*y*y*w*OK", &ctrl, &handles, &keys, &ids, &out, &bucket_obj, &groups))
        return NULL;
    PyObject *result = NULL;
    Index ix;
    int want_bucket = bucket_obj != Py_None;
    if (want_bucket && PyObject_GetBuffer(bucket_obj, &bucket, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        goto done;
    Py_ssize_t n = ids.len / 8;
    if (index_from(&ix, &ctrl, &handles, groups) < 0 || check_i64(&keys, "keys", -1) < 0 ||
        check_i64(&ids, "ids", n) < 0 || check_i64(&out, "out", n) < 0 || (want_bucket && check_i64(&bucket, "bucket", n) < 0))
        goto done;
    const int64_t *key = (const int64_t *)keys.buf, *id = (const int64_t *)ids.buf;
    int64_t *found = (int64_t *)out.buf, *where = want_bucket ? (int64_t *)bucket.buf : NULL;
    int64_t nkeys = (int64_t)(keys.len / 8);
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n && i < AHEAD; i++)
        prefetch_home(&ix, id[i]);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + AHEAD < n)
            prefetch_home(&ix, id[i + AHEAD]);
        uint64_t g;
        uint8_t fp;
        hash_of(&ix, id[i], &g, &fp);
        int64_t h = -1, b = -1;
        for (uint64_t k = 0; k < ix.groups; k++, g = g + 1 == ix.groups ? 0 : g + 1) {
            const uint8_t *c = ix.ctrl + g * GROUP;
            int open = 0;
            for (int j = 0; j < GROUP; j++) {
                if (c[j] == fp) {
                    int64_t cand = handle_at(&ix, g * GROUP + j);
                    if (cand >= 0 && cand < nkeys && key[cand] == id[i]) {
                        h = cand;
                        b = (int64_t)(g * GROUP + j);
                        goto next;
                    }
                }
                open |= c[j] == EMPTY;
            }
            if (open)
                break;
        }
    next:
        found[i] = h;
        if (where)
            where[i] = b;
    }
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&ctrl);
    PyBuffer_Release(&handles);
    PyBuffer_Release(&keys);
    PyBuffer_Release(&ids);
    PyBuffer_Release(&out);
    if (want_bucket && bucket.obj)
        PyBuffer_Release(&bucket);
    return result;
}

static PyObject *probe_place(PyObject *self, PyObject *args) {
    Py_buffer ctrl, handles, ids, vals;
    unsigned long long groups;
    if (!PyArg_ParseTuple(args, "w*w*y*y*K", &ctrl, &handles, &ids, &vals, &groups))
        return NULL;
    PyObject *result = NULL;
    Index ix;
    Py_ssize_t n = ids.len / 8;
    if (index_from(&ix, &ctrl, &handles, groups) < 0 || check_i64(&ids, "ids", n) < 0 || check_i64(&vals, "handles_in", n) < 0)
        goto done;
    const int64_t *id = (const int64_t *)ids.buf, *val = (const int64_t *)vals.buf;
    uint8_t *bytes = (uint8_t *)ctrl.buf;
    Py_ssize_t taken_empty = 0, placed = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + AHEAD < n)
            prefetch_home(&ix, id[i + AHEAD]);
        uint64_t g;
        uint8_t fp;
        hash_of(&ix, id[i], &g, &fp);
        for (uint64_t k = 0; k < ix.groups; k++, g = g + 1 == ix.groups ? 0 : g + 1) {
            uint8_t *c = bytes + g * GROUP;
            int j = 0;
            while (j < GROUP && c[j] != EMPTY && c[j] != DELETED)
                j++;
            if (j < GROUP) {
                taken_empty += c[j] == EMPTY;
                c[j] = fp;
                if (ix.wide)
                    ((int64_t *)ix.handles)[g * GROUP + j] = val[i];
                else
                    ((int32_t *)ix.handles)[g * GROUP + j] = (int32_t)val[i];
                placed++;
                break;
            }
        }
    }
    Py_END_ALLOW_THREADS
    if (placed != n) {
        PyErr_Format(PyExc_RuntimeError, "the index is full: %zd of %zd ids placed", placed, n);
        goto done;
    }
    result = PyLong_FromSsize_t(taken_empty);
done:
    PyBuffer_Release(&ctrl);
    PyBuffer_Release(&handles);
    PyBuffer_Release(&ids);
    PyBuffer_Release(&vals);
    return result;
}

static PyMethodDef methods[] = {
    {"find", probe_find, METH_VARARGS, "find(ctrl, handles, keys, ids, out, bucket_or_None, groups): each id's handle, -1 where absent."},
    {"place", probe_place, METH_VARARGS, "place(ctrl, handles, ids, handles_in, groups) -> EMPTY buckets taken."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "hash_probe", "The hash index's inner loops in C.", -1, methods};

PyMODINIT_FUNC PyInit_hash_probe(void) { return PyModule_Create(&module); }
