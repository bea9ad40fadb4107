/* The codec's common case in C: a request or reply packed, or read and checked, in one call.

   configure(request, reply, message, dtypes, as_is, ndarray, ext_type, extract, wire_buffer,
             struct, struct_layout, required)
       once, from zmqflow/wire/codec.py: the kinds, the Message class, the wire dtypes by name (a
       live dict), the wire names of the dtypes sent as they are (dtypes.AS_IS), np.ndarray
       (which also builds each received array over its frame),
       msgpack.ExtType, the codec's own _extract and _wire_buffer for what is not plain data,
       msgspec.Struct and the codec's description of a struct's fields (a declared request goes
       out as the map of its fields that are not their defaults, an item as the list of its
       fields).
   encode(request, id, service, op, deadline, source, body)   -> [header, buffers...] | None
   decode(frames, limits)                                      -> Message | None
   nbytes(frames)                                              -> the bytes in outgoing frames

   None means "not the common case here": the caller then runs the Python codec, which handles
   it or raises the error that names the fault. So nothing here explains a failure, and nothing
   is accepted that the Python codec refuses: every check is at least as strict as its own, and
   anything unusual (an error message, an unknown field, a duplicate key, a deep nest, a dtype
   not yet loaded) goes back to it. The bytes written are the ones msgpack's Packer writes
   (use_bin_type, doubles, smallest integer forms); tests compare both codecs on random bodies.

   join(entries) -> (lengths, data), split(lengths, data, max_frames) -> entries | None
       the batch envelope's data frame (codec_batch.c; see zmqflow/wire/batch.py).

   codec_write.c writes, codec_read.c reads; codec_c.h is what they share. */

#include "codec_c.h"

PyObject *K_REQ, *K_REP, *MESSAGE, *DTYPES, *AS_IS, *NDARRAY, *EXTTYPE, *EXTRACT, *WIRE_BUFFER;
PyObject *STRUCT, *LAYOUT, *REQUIRED, *LAYOUTS;  /* msgspec.Struct, the codec's _struct_layout, its cache */
PyObject *EMPTY, *S_ITEMSIZE, *S_SHAPE, *S_DTYPE;
PyObject *MSG_FIELDS[MSG_NFIELDS];

/* Message's slot descriptors: a decoded message is made by setting them on a new instance, where
   calling the class would run its Python __init__ (a frame on every message received) */
static void find_message_slots(void) {
    static const char *names[MSG_NFIELDS] = {"kind", "id", "service", "op", "body", "deadline", "source", "error"};
    for (int i = 0; i < MSG_NFIELDS; i++)
        Py_CLEAR(MSG_FIELDS[i]);
    for (int i = 0; i < MSG_NFIELDS; i++) {
        PyObject *d = PyDict_GetItemString(((PyTypeObject *)MESSAGE)->tp_dict, names[i]);  /* borrowed */
        if (d == NULL || Py_TYPE(d)->tp_descr_set == NULL || Py_TYPE(d)->tp_descr_get == NULL) {
            for (int j = 0; j < MSG_NFIELDS; j++)
                Py_CLEAR(MSG_FIELDS[j]);
            return;
        }
        Py_INCREF(d);
        MSG_FIELDS[i] = d;
    }
}

static PyObject *configure(PyObject *self, PyObject *args) {
    PyObject *o[12];
    if (!PyArg_ParseTuple(args, "UUOO!O!OOOOOOO", &o[0], &o[1], &o[2], &PyDict_Type, &o[3], &PyDict_Type, &o[4], &o[5],
                          &o[6], &o[7], &o[8], &o[9], &o[10], &o[11]))
        return NULL;
    PyObject **slots[12] = {&K_REQ, &K_REP, &MESSAGE, &DTYPES, &AS_IS, &NDARRAY, &EXTTYPE, &EXTRACT, &WIRE_BUFFER,
                            &STRUCT, &LAYOUT, &REQUIRED};
    PyObject *cache = PyDict_New();
    if (cache == NULL)
        return NULL;
    Py_XSETREF(LAYOUTS, cache);
    for (int i = 0; i < 12; i++) {
        Py_INCREF(o[i]);
        Py_XSETREF(*slots[i], o[i]);
    }
    if (!PyType_Check(MESSAGE)) {
        PyErr_SetString(PyExc_TypeError, "configure: message must be a class");
        return NULL;
    }
    find_message_slots();
    Py_RETURN_NONE;
}

/* the bytes in outgoing frames (bytes and buffers): a frame that exports no buffer is an error.
   A frame's ``nbytes`` runs Python code that may change the list: its size is checked at every
   frame, and each frame held while it is measured. */
static PyObject *codec_nbytes(PyObject *self, PyObject *frames) {
    PyObject *seq = PySequence_Fast(frames, "nbytes takes a sequence of frames");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = 0;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        PyObject *f = PySequence_Fast_GET_ITEM(seq, i);
        if (PyBytes_CheckExact(f)) {
            n += PyBytes_GET_SIZE(f);
            continue;
        }
        Py_INCREF(f);
        Py_buffer view;
        Py_ssize_t k;
        if (PyObject_GetBuffer(f, &view, PyBUF_SIMPLE) < 0) {  /* a strided array: its nbytes, as numpy says */
            PyErr_Clear();
            PyObject *nb = PyObject_GetAttrString(f, "nbytes");
            k = nb == NULL ? -1 : PyLong_AsSsize_t(nb);
            Py_XDECREF(nb);
            if (k < 0 && !PyErr_Occurred())
                PyErr_Format(PyExc_ValueError, "a frame's nbytes is negative (%zd)", k);
        } else {
            k = view.len;
            PyBuffer_Release(&view);
        }
        Py_DECREF(f);
        if (k >= 0 && k > PY_SSIZE_T_MAX - n) {
            PyErr_SetString(PyExc_OverflowError, "frames of more bytes than a size holds");
            k = -1;
        }
        if (k < 0) {
            Py_DECREF(seq);
            return NULL;
        }
        n += k;
    }
    Py_DECREF(seq);
    return PyLong_FromSsize_t(n);
}

static PyMethodDef methods[] = {
    {"configure", configure, METH_VARARGS, "Set the kinds, classes and hooks the fast path uses."},
    {"encode", (PyCFunction)(void (*)(void))codec_encode, METH_FASTCALL, "Frames of a request or reply, or None."},
    {"decode", (PyCFunction)(void (*)(void))codec_decode, METH_FASTCALL, "A request or reply Message, or None."},
    {"join", codec_join, METH_O, "A batch envelope's lengths and data frame."},
    {"nbytes", codec_nbytes, METH_O, "The bytes in outgoing frames."},
    {"split", (PyCFunction)(void (*)(void))codec_split, METH_FASTCALL, "A batch envelope's entries, or None."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "codec_c", NULL, -1, methods};

PyMODINIT_FUNC PyInit_codec_c(void) {
    EMPTY = PyUnicode_FromString("");
    S_ITEMSIZE = PyUnicode_InternFromString("itemsize");
    S_SHAPE = PyUnicode_InternFromString("shape");
    S_DTYPE = PyUnicode_InternFromString("dtype");
    if (EMPTY == NULL || S_ITEMSIZE == NULL || S_SHAPE == NULL || S_DTYPE == NULL)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && (PyModule_AddIntConstant(m, "PACK_BELOW", PACK_BELOW) ||
                      PyModule_AddIntConstant(m, "PACK_ALIGN", PACK_ALIGN) ||
                      PyModule_AddIntConstant(m, "PACK_BYTES", PACK_BYTES))) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
