/* What the compiled codec's files share: the kinds, classes and hooks configure() set, and the
   two entry points. See codec_c.c. */

#ifndef ZMQFLOW_CODEC_C_H
#define ZMQFLOW_CODEC_C_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__GNUC__)
#define ZFC_HIDDEN __attribute__((visibility("hidden")))
#else
#define ZFC_HIDDEN
#endif

#define MAX_DEPTH 32     /* deeper nests go to the Python codec (which enforces Limits.max_depth) */
#define INLINE_REFS 64   /* tensor references read without an allocation; more go to the heap */
#define MAX_REFS 65536   /* tensor references per message handled here (more: the Python codec) */
#define MAX_NDIM 32
/* as zmqflow/wire/tensors.py: two or more arrays of 1..PACK_BELOW-1 bytes share pack frames */
#define PACK_BELOW (16 << 10)
#define PACK_ALIGN 16
#define PACK_BYTES (1 << 20)
#define MAX_NAME 128

/* set once by configure(): see codec_c.c */
extern ZFC_HIDDEN PyObject *K_REQ, *K_REP, *MESSAGE, *DTYPES, *AS_IS, *NDARRAY, *EXTTYPE, *EXTRACT, *WIRE_BUFFER;
extern ZFC_HIDDEN PyObject *STRUCT, *LAYOUT, *REQUIRED, *LAYOUTS;
extern ZFC_HIDDEN PyObject *EMPTY, *S_ITEMSIZE, *S_SHAPE, *S_DTYPE;
/* the Message class's slot descriptors, in its fields' order (kind, id, service, op, body,
   deadline, source, error); MSG_FIELDS[0] NULL when the class has no such slots */
#define MSG_NFIELDS 8
extern ZFC_HIDDEN PyObject *MSG_FIELDS[MSG_NFIELDS];

ZFC_HIDDEN PyObject *codec_encode(PyObject *self, PyObject *const *args, Py_ssize_t nargs);  /* codec_write.c */
ZFC_HIDDEN PyObject *codec_decode(PyObject *self, PyObject *const *args, Py_ssize_t nargs);  /* codec_read.c */
ZFC_HIDDEN PyObject *codec_join(PyObject *self, PyObject *entries);                         /* codec_batch.c */
ZFC_HIDDEN PyObject *codec_split(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

#endif
