/* The batch envelope's data frame in C (see zmqflow/wire/batch.py): entries' frames joined back
   to back at multiples of 8 bytes, and cut apart again.

   join(entries)                -> (lengths, data)   every frame's length, per entry; the joined bytes
   split(lengths, data, frames) -> [[view, ...], ...] | None   views into data, per entry

   split returns None for anything batch.py would refuse (a length that is not a non-negative int,
   an entry of no frames or of more than ``frames``, data too short or too long): batch.py then
   walks the table itself and names the fault. */

#include "codec_c.h"

#define ALIGN 8

PyObject *codec_join(PyObject *self, PyObject *entries) {
    if (!PyList_CheckExact(entries)) {
        PyErr_SetString(PyExc_TypeError, "join takes a list of entries");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(entries), total = 0;
    PyObject *lengths = PyList_New(n), *data = NULL, *out = NULL;
    if (lengths == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {  /* the lengths, and the size with padding */
        PyObject *seq = PySequence_Fast(PyList_GET_ITEM(entries, i), "an entry is a sequence of frames");
        if (seq == NULL)
            goto done;
        Py_ssize_t k = PySequence_Fast_GET_SIZE(seq);
        PyObject *sizes = PyList_New(k);
        if (sizes == NULL) {
            Py_DECREF(seq);
            goto done;
        }
        PyList_SET_ITEM(lengths, i, sizes);  /* the list of lengths holds it */
        for (Py_ssize_t j = 0; j < k; j++) {
            Py_buffer view;
            if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, j), &view, PyBUF_SIMPLE)) {
                Py_DECREF(seq);
                goto done;
            }
            total += (-total & (ALIGN - 1)) + view.len;
            PyObject *len = PyLong_FromSsize_t(view.len);
            PyBuffer_Release(&view);
            if (len == NULL) {
                Py_DECREF(seq);
                goto done;
            }
            PyList_SET_ITEM(sizes, j, len);
        }
        Py_DECREF(seq);
    }
    data = PyBytes_FromStringAndSize(NULL, total);
    if (data == NULL)
        goto done;
    char *p = PyBytes_AS_STRING(data);
    Py_ssize_t pos = 0;
    for (Py_ssize_t i = 0; i < n; i++) {  /* the frames, each at a multiple of ALIGN */
        PyObject *seq = PySequence_Fast(PyList_GET_ITEM(entries, i), "an entry is a sequence of frames");
        if (seq == NULL)
            goto done;
        for (Py_ssize_t j = 0; j < PySequence_Fast_GET_SIZE(seq); j++) {
            Py_buffer view;
            if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, j), &view, PyBUF_SIMPLE)) {
                Py_DECREF(seq);
                goto done;
            }
            Py_ssize_t pad = -pos & (ALIGN - 1);
            int fits = pos + pad + view.len <= total;  /* a frame that grew since it was measured does not */
            if (fits) {
                memset(p + pos, 0, pad);
                memcpy(p + pos + pad, view.buf, view.len);
                pos += pad + view.len;
            }
            PyBuffer_Release(&view);
            if (!fits) {
                Py_DECREF(seq);
                PyErr_SetString(PyExc_ValueError, "a frame changed size while its envelope was made");
                goto done;
            }
        }
        Py_DECREF(seq);
    }
    out = PyTuple_Pack(2, lengths, data);
done:
    Py_DECREF(lengths);
    Py_XDECREF(data);
    return out;
}

PyObject *codec_split(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "split takes 3 arguments");
        return NULL;
    }
    PyObject *table = args[0], *data = args[1];
    Py_ssize_t max_frames = PyLong_AsSsize_t(args[2]);
    if (max_frames == -1 && PyErr_Occurred())
        return NULL;
    if (!PyList_CheckExact(table))
        Py_RETURN_NONE;
    PyObject *view = PyMemoryView_FromObject(data);
    if (view == NULL)
        return NULL;
    Py_buffer *buf = PyMemoryView_GET_BUFFER(view);  /* sliced by bytes: one-dimensional bytes only */
    Py_ssize_t end = buf->len, pos = 0, n = PyList_GET_SIZE(table);
    PyObject *entries = buf->ndim == 1 && buf->itemsize == 1 ? PyList_New(n) : NULL;
    for (Py_ssize_t i = 0; entries != NULL && i < n; i++) {
        PyObject *sizes = PyList_GET_ITEM(table, i);
        Py_ssize_t k = PyList_CheckExact(sizes) ? PyList_GET_SIZE(sizes) : 0;
        PyObject *entry = k >= 1 && k <= max_frames ? PyList_New(k) : NULL;
        if (entry == NULL) {
            Py_CLEAR(entries);
            break;
        }
        PyList_SET_ITEM(entries, i, entry);
        for (Py_ssize_t j = 0; j < k; j++) {
            PyObject *len = PyList_GET_ITEM(sizes, j);
            Py_ssize_t m = PyLong_CheckExact(len) ? PyLong_AsSsize_t(len) : -1;
            pos += -pos & (ALIGN - 1);
            PyObject *part = m >= 0 && m <= end - pos ? PySequence_GetSlice(view, pos, pos + m) : NULL;
            if (part == NULL) {
                Py_CLEAR(entries);
                break;
            }
            PyList_SET_ITEM(entry, j, part);
            pos += m;
        }
    }
    Py_DECREF(view);
    if (entries == NULL || pos != end) {
        Py_XDECREF(entries);
        if (PyErr_Occurred() && PyErr_ExceptionMatches(PyExc_MemoryError))
            return NULL;
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    return entries;
}
