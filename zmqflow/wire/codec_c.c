/* The codec's common case in C: a request or reply packed, or read and checked, in one call.

   configure(request, reply, message, dtypes, ndarray, ext_type, extract, wire_buffer,
             struct, struct_layout, required)
       once, from zmqflow/wire/codec.py: the kinds, the Message class, the wire dtypes by name (a
       live dict), np.ndarray (which also builds each received array over its frame),
       msgpack.ExtType, the codec's own _extract and _wire_buffer for what is not plain data,
       msgspec.Struct and the codec's description of a struct's fields (a declared request goes
       out as the map of its fields that are not their defaults, an item as the list of its
       fields).
   encode(request, id, service, op, deadline, source, body)   -> [header, buffers...] | None
   decode(frames, limits)                                      -> Message | None

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

PyObject *K_REQ, *K_REP, *MESSAGE, *DTYPES, *NDARRAY, *EXTTYPE, *EXTRACT, *WIRE_BUFFER;
PyObject *STRUCT, *LAYOUT, *REQUIRED, *LAYOUTS;  /* msgspec.Struct, the codec's _struct_layout, its cache */
PyObject *EMPTY, *S_ITEMSIZE, *S_SHAPE;

static PyObject *configure(PyObject *self, PyObject *args) {
    PyObject *o[11];
    if (!PyArg_ParseTuple(args, "UUOO!OOOOOOO", &o[0], &o[1], &o[2], &PyDict_Type, &o[3], &o[4], &o[5], &o[6], &o[7],
                          &o[8], &o[9], &o[10]))
        return NULL;
    PyObject **slots[11] = {&K_REQ, &K_REP, &MESSAGE, &DTYPES, &NDARRAY, &EXTTYPE, &EXTRACT, &WIRE_BUFFER,
                            &STRUCT, &LAYOUT, &REQUIRED};
    PyObject *cache = PyDict_New();
    if (cache == NULL)
        return NULL;
    Py_XSETREF(LAYOUTS, cache);
    for (int i = 0; i < 11; i++) {
        Py_INCREF(o[i]);
        Py_XSETREF(*slots[i], o[i]);
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"configure", configure, METH_VARARGS, "Set the kinds, classes and hooks the fast path uses."},
    {"encode", (PyCFunction)(void (*)(void))codec_encode, METH_FASTCALL, "Frames of a request or reply, or None."},
    {"decode", (PyCFunction)(void (*)(void))codec_decode, METH_FASTCALL, "A request or reply Message, or None."},
    {"join", codec_join, METH_O, "A batch envelope's lengths and data frame."},
    {"split", (PyCFunction)(void (*)(void))codec_split, METH_FASTCALL, "A batch envelope's entries, or None."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "codec_c", NULL, -1, methods};

PyMODINIT_FUNC PyInit_codec_c(void) {
    EMPTY = PyUnicode_FromString("");
    S_ITEMSIZE = PyUnicode_InternFromString("itemsize");
    S_SHAPE = PyUnicode_InternFromString("shape");
    if (EMPTY == NULL || S_ITEMSIZE == NULL || S_SHAPE == NULL)
        return NULL;
    return PyModule_Create(&module);
}
