/* The batch envelope's data frame in C (see zmqflow/wire/batch.py): entries' frames joined back
   to back at multiples of 8 bytes, and cut apart again.

   join(entries)                -> (lengths, data)   every frame's length, per entry; the joined bytes
       entries: a list of lists or tuples of buffers; anything else raises TypeError or ValueError
       before any entry is used up, and batch.py's own loop joins them
   split(lengths, data, frames) -> [[view, ...], ...] | None   views into data, per entry

   split returns None for anything batch.py would refuse (a length that is not a non-negative int,
   an entry of no frames or of more than ``frames``, data too short or too long): batch.py then
   walks the table itself and names the fault. */

#include "codec_c.h"

#define ALIGN 8

/* an entry's frame ``j`` (a new reference), or NULL with ValueError when the entry no longer has
   one: Python code run meanwhile (a finalizer) may change a list */
static PyObject *frame_at(PyObject *seq, Py_ssize_t j) {
    if (j >= PySequence_Fast_GET_SIZE(seq)) {
        PyErr_SetString(PyExc_ValueError, "an entry changed while its envelope was made");
        return NULL;
    }
    PyObject *f = PySequence_Fast_GET_ITEM(seq, j);
    Py_INCREF(f);
    return f;
}

/* Each entry is a list or tuple, read in both passes (measured, then copied): anything else
   (a generator, a one-shot iterator) goes to batch.py's loop, untouched, so that nothing is used
   up here. Every frame must still have the length measured, or the lengths would not describe
   the data. */
PyObject *codec_join(PyObject *self, PyObject *entries) {
    if (!PyList_CheckExact(entries)) {
        PyErr_SetString(PyExc_TypeError, "join takes a list of entries");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(entries), total = 0;
    PyObject *lengths = PyList_New(n), *seqs = PyTuple_New(n), *data = NULL, *out = NULL;
    if (lengths == NULL || seqs == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {  /* the lengths, and the size with padding */
        if (i >= PyList_GET_SIZE(entries)) {
            PyErr_SetString(PyExc_ValueError, "the entries changed while their envelope was made");
            goto done;
        }
        PyObject *seq = PyList_GET_ITEM(entries, i);
        if (!PyList_CheckExact(seq) && !PyTuple_CheckExact(seq)) {
            PyErr_SetString(PyExc_TypeError, "an entry is a list or tuple of frames");
            goto done;
        }
        Py_INCREF(seq);
        PyTuple_SET_ITEM(seqs, i, seq);  /* held for the second pass */
        Py_ssize_t k = PySequence_Fast_GET_SIZE(seq);
        PyObject *sizes = PyList_New(k);
        if (sizes == NULL)
            goto done;
        PyList_SET_ITEM(lengths, i, sizes);  /* the list of lengths holds it */
        for (Py_ssize_t j = 0; j < k; j++) {
            PyObject *f = frame_at(seq, j);
            Py_buffer view;
            int bad = f == NULL || PyObject_GetBuffer(f, &view, PyBUF_SIMPLE);
            Py_XDECREF(f);
            if (bad)
                goto done;
            total += (-total & (ALIGN - 1)) + view.len;
            PyObject *len = PyLong_FromSsize_t(view.len);
            PyBuffer_Release(&view);
            if (len == NULL)
                goto done;
            PyList_SET_ITEM(sizes, j, len);
        }
    }
    data = PyBytes_FromStringAndSize(NULL, total);
    if (data == NULL)
        goto done;
    char *p = PyBytes_AS_STRING(data);
    Py_ssize_t pos = 0;
    for (Py_ssize_t i = 0; i < n; i++) {  /* the frames, each at a multiple of ALIGN */
        PyObject *seq = PyTuple_GET_ITEM(seqs, i), *sizes = PyList_GET_ITEM(lengths, i);
        for (Py_ssize_t j = 0; j < PyList_GET_SIZE(sizes); j++) {
            PyObject *f = frame_at(seq, j);
            Py_buffer view;
            if (f == NULL || PyObject_GetBuffer(f, &view, PyBUF_SIMPLE)) {
                Py_XDECREF(f);
                goto done;
            }
            Py_DECREF(f);  /* the view holds what it exports */
            Py_ssize_t pad = -pos & (ALIGN - 1);
            int fits = view.len == PyLong_AsSsize_t(PyList_GET_ITEM(sizes, j)) && pos + pad + view.len <= total;
            if (fits) {
                memset(p + pos, 0, pad);
                memcpy(p + pos + pad, view.buf, view.len);
                pos += pad + view.len;
            }
            PyBuffer_Release(&view);
            if (!fits) {  /* a frame that changed size since it was measured */
                PyErr_SetString(PyExc_ValueError, "a frame changed size while its envelope was made");
                goto done;
            }
        }
    }
    if (pos != total) {  /* every byte of data written: nothing stale goes out */
        PyErr_SetString(PyExc_ValueError, "an entry changed while its envelope was made");
        goto done;
    }
    out = PyTuple_Pack(2, lengths, data);
done:
    Py_XDECREF(lengths);
    Py_XDECREF(seqs);
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
