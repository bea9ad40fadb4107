/* The codec's common case in C: a request or reply packed, or read and checked, in one call.

   configure(request, reply, message, frombuffer, dtypes, ndarray, ext_type, extract, wire_buffer)
       once, from zmqflow/wire/codec.py: the kinds, the Message class, np.frombuffer, the wire
       dtypes by name (a live dict), np.ndarray, msgpack.ExtType, and the codec's own _extract
       and _wire_buffer for what is not plain data.
   encode(request, id, service, op, deadline, source, body)   -> [header, buffers...] | None
   decode(frames, limits)                                      -> Message | None

   None means "not the common case here": the caller then runs the Python codec, which handles
   it or raises the error that names the fault. So nothing here explains a failure, and nothing
   is accepted that the Python codec refuses: every check is at least as strict as its own, and
   anything unusual (an error message, an unknown field, a duplicate key, a deep nest, a dtype
   not yet loaded) goes back to it. The bytes written are the ones msgpack's Packer writes
   (use_bin_type, doubles, smallest integer forms); tests compare both codecs on random bodies. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_DEPTH 32     /* deeper nests go to the Python codec (which enforces Limits.max_depth) */
#define MAX_REFS 64      /* tensor references per message handled here */
#define MAX_NDIM 32
#define MAX_NAME 128

static PyObject *K_REQ, *K_REP, *MESSAGE, *FROMBUFFER, *DTYPES, *NDARRAY, *EXTTYPE, *EXTRACT, *WIRE_BUFFER;
static PyObject *EMPTY, *S_ITEMSIZE, *S_RESHAPE, *S_SHAPE;
static PyObject *LIMITS;  /* the Limits last read, and its values */
static Py_ssize_t L_HEADER, L_FRAMES, L_CONTAINER, L_DEPTH;
static long long L_FRAME_BYTES, L_MESSAGE_BYTES;

/* writing ---------------------------------------------------------------------------------- */

typedef struct {
    char *buf;
    Py_ssize_t len, cap;
    char small[512];
} W;

static int w_room(W *w, Py_ssize_t n) {
    if (w->len + n <= w->cap)
        return 0;
    Py_ssize_t cap = w->cap * 2;
    while (cap < w->len + n)
        cap *= 2;
    char *nb = w->buf == w->small ? PyMem_Malloc(cap) : PyMem_Realloc(w->buf, cap);
    if (nb == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    if (w->buf == w->small)
        memcpy(nb, w->small, w->len);
    w->buf = nb;
    w->cap = cap;
    return 0;
}

static int w_put(W *w, const void *p, Py_ssize_t n) {
    if (w_room(w, n))
        return -1;
    memcpy(w->buf + w->len, p, n);
    w->len += n;
    return 0;
}

/* a marker byte followed by ``n`` big-endian bytes of ``v`` (n = 0, 1, 2, 4 or 8) */
static int w_tag(W *w, unsigned char tag, uint64_t v, int n) {
    if (w_room(w, 1 + n))
        return -1;
    unsigned char *p = (unsigned char *)w->buf + w->len;
    p[0] = tag;
    for (int i = 0; i < n; i++)
        p[1 + i] = (unsigned char)(v >> (8 * (n - 1 - i)));
    w->len += 1 + n;
    return 0;
}

/* the header of a str, bin, array or map of ``n``: fix (small) form, else 1-, 2- or 4-byte lengths */
static int w_len(W *w, Py_ssize_t n, unsigned char fix, Py_ssize_t fix_max, unsigned char t8,
                 unsigned char t16, unsigned char t32) {
    if (fix && n < fix_max)
        return w_tag(w, (unsigned char)(fix | n), 0, 0);
    if (t8 && n < 256)
        return w_tag(w, t8, (uint64_t)n, 1);
    if (n < 65536)
        return w_tag(w, t16, (uint64_t)n, 2);
    if ((uint64_t)n <= 0xffffffffu)
        return w_tag(w, t32, (uint64_t)n, 4);
    PyErr_SetString(PyExc_ValueError, "too long");
    return -1;
}

static int w_int(W *w, PyObject *o) {
    int overflow;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (overflow > 0) {
        unsigned long long u = PyLong_AsUnsignedLongLong(o);
        return (u == (unsigned long long)-1 && PyErr_Occurred()) ? -1 : w_tag(w, 0xcf, u, 8);
    }
    if (overflow < 0 || (v == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        PyErr_SetString(PyExc_OverflowError, "int out of range");
        return -1;
    }
    if (v >= -32 && v < 128)
        return w_tag(w, (unsigned char)(int8_t)v, 0, 0);
    if (v < 0) {
        if (v >= -128)
            return w_tag(w, 0xd0, (uint8_t)(int8_t)v, 1);
        if (v >= -32768)
            return w_tag(w, 0xd1, (uint16_t)(int16_t)v, 2);
        if (v >= -2147483648LL)
            return w_tag(w, 0xd2, (uint32_t)(int32_t)v, 4);
        return w_tag(w, 0xd3, (uint64_t)v, 8);
    }
    if (v < 256)
        return w_tag(w, 0xcc, (uint64_t)v, 1);
    if (v < 65536)
        return w_tag(w, 0xcd, (uint64_t)v, 2);
    if (v <= 0xffffffffLL)
        return w_tag(w, 0xce, (uint64_t)v, 4);
    return w_tag(w, 0xcf, (uint64_t)v, 8);
}

static int w_str(W *w, PyObject *o) {
    Py_ssize_t n;
    const char *s = PyUnicode_AsUTF8AndSize(o, &n);
    if (s == NULL || w_len(w, n, 0xa0, 32, 0xd9, 0xda, 0xdb))
        return -1;
    return w_put(w, s, n);
}

static int w_ext(W *w, PyObject *o) {
    PyObject *code = PyTuple_GET_ITEM(o, 0), *data = PyTuple_GET_ITEM(o, 1);
    if (!PyLong_CheckExact(code) || !PyBytes_CheckExact(data)) {
        PyErr_SetString(PyExc_TypeError, "ExtType");
        return -1;
    }
    long c = PyLong_AsLong(code);
    Py_ssize_t n = PyBytes_GET_SIZE(data);
    if (c < 0 || c > 127)
        return -1;
    static const unsigned char fixed[17] = {0, 0xd4, 0xd5, 0, 0xd6, 0, 0, 0, 0xd7, 0, 0, 0, 0, 0, 0, 0, 0xd8};
    int r;
    if (n <= 16 && fixed[n])
        r = w_tag(w, fixed[n], 0, 0);
    else
        r = w_len(w, n, 0, 0, 0xc7, 0xc8, 0xc9);
    if (r || w_tag(w, (unsigned char)c, 0, 0))
        return -1;
    return w_put(w, PyBytes_AS_STRING(data), n);
}

/* ``o`` as msgpack; arrays (with ``arrays`` given) become tensor references appended to it, and
   other values go through the codec's _extract once (``hooked``: already did, or a map key) */
static int w_obj(W *w, PyObject *o, PyObject *arrays, int depth, int hooked) {
    if (depth > MAX_DEPTH) {
        PyErr_SetString(PyExc_ValueError, "deep");
        return -1;
    }
    PyTypeObject *t = Py_TYPE(o);
    if (o == Py_None)
        return w_tag(w, 0xc0, 0, 0);
    if (o == Py_True || o == Py_False)
        return w_tag(w, o == Py_True ? 0xc3 : 0xc2, 0, 0);
    if (t == &PyLong_Type)
        return w_int(w, o);
    if (t == &PyFloat_Type) {
        double d = PyFloat_AS_DOUBLE(o);
        uint64_t bits;
        memcpy(&bits, &d, 8);
        return w_tag(w, 0xcb, bits, 8);
    }
    if (t == &PyUnicode_Type)
        return w_str(w, o);
    if (t == &PyBytes_Type) {
        Py_ssize_t n = PyBytes_GET_SIZE(o);
        return w_len(w, n, 0, 0, 0xc4, 0xc5, 0xc6) ? -1 : w_put(w, PyBytes_AS_STRING(o), n);
    }
    if (t == &PyDict_Type) {
        if (w_len(w, PyDict_GET_SIZE(o), 0x80, 16, 0, 0xde, 0xdf))
            return -1;
        Py_ssize_t pos = 0;
        PyObject *k, *v;
        while (PyDict_Next(o, &pos, &k, &v)) {
            Py_INCREF(k);
            Py_INCREF(v);
            int r = w_obj(w, k, NULL, depth + 1, 1) || w_obj(w, v, arrays, depth + 1, hooked);
            Py_DECREF(k);
            Py_DECREF(v);
            if (r)
                return -1;
        }
        return 0;
    }
    if (t == &PyList_Type || t == &PyTuple_Type) {
        PyObject *seq = PySequence_Fast(o, "");  /* a new reference: the list may change under a hook */
        if (seq == NULL)
            return -1;
        Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
        int r = w_len(w, n, 0x90, 16, 0, 0xdc, 0xdd);
        for (Py_ssize_t i = 0; !r && i < n; i++)
            r = w_obj(w, PySequence_Fast_GET_ITEM(seq, i), arrays, depth + 1, hooked);
        Py_DECREF(seq);
        return r;
    }
    if (arrays != NULL && t == (PyTypeObject *)NDARRAY) {
        Py_ssize_t index = PyList_GET_SIZE(arrays);
        if (index > 0xffffffffLL || PyList_Append(arrays, o))
            return -1;
        return w_tag(w, 0xd6, 0x0100000000ULL | (uint64_t)index, 5);
    }
    if (t == (PyTypeObject *)EXTTYPE && hooked)  /* a reference _extract made (a caller's own goes to it: a list) */
        return w_ext(w, o);
    if (hooked || arrays == NULL) {
        PyErr_SetString(PyExc_TypeError, "not plain");
        return -1;
    }
    PyObject *x = PyObject_CallFunctionObjArgs(EXTRACT, o, arrays, NULL);
    if (x == NULL)
        return -1;
    int r = w_obj(w, x, arrays, depth, 1);
    Py_DECREF(x);
    return r;
}

static int w_key(W *w, const char *key) {
    size_t n = strlen(key);
    return w_tag(w, (unsigned char)(0xa0 | n), 0, 0) || w_put(w, key, (Py_ssize_t)n);
}

/* the tensor table [[dtype, shape, frame], ...], and each array's buffer appended to ``frames`` */
static int w_table(W *w, PyObject *arrays, PyObject *frames) {
    Py_ssize_t n = PyList_GET_SIZE(arrays);
    if (w_len(w, n, 0x90, 16, 0, 0xdc, 0xdd))
        return -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *arr = PyList_GET_ITEM(arrays, i);
        PyObject *pair = PyObject_CallOneArg(WIRE_BUFFER, arr);
        if (pair == NULL)
            return -1;
        PyObject *shape = PyObject_GetAttr(arr, S_SHAPE);
        int r = shape == NULL || !PyTuple_CheckExact(pair) || PyTuple_GET_SIZE(pair) != 2 ||
                PyList_Append(frames, PyTuple_GET_ITEM(pair, 0)) || w_tag(w, 0x93, 0, 0) ||
                w_obj(w, PyTuple_GET_ITEM(pair, 1), NULL, 0, 1) || w_obj(w, shape, NULL, 0, 1);
        Py_DECREF(pair);
        Py_XDECREF(shape);
        if (r) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError, "table");
            return -1;
        }
        PyObject *at = PyLong_FromSsize_t(i + 1);
        r = at == NULL || w_int(w, at);
        Py_XDECREF(at);
        if (r)
            return -1;
    }
    return 0;
}

static PyObject *encode(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "encode takes 7 arguments");
        return NULL;
    }
    int request = PyObject_IsTrue(args[0]);
    PyObject *id = args[1], *service = args[2], *op = args[3], *dl = args[4], *source = args[5], *body = args[6];
    int with_source = PyObject_IsTrue(source);
    if (request < 0 || with_source < 0)
        return NULL;
    W w = {.len = 0, .cap = sizeof w.small};
    w.buf = w.small;
    PyObject *arrays = PyList_New(0), *frames = PyList_New(1);
    PyObject *out = NULL;
    if (arrays == NULL || frames == NULL)
        goto done;
    Py_ssize_t fields = 5 + with_source + (request ? 2 + (dl != Py_None) : 0);
    if (w_tag(&w, (unsigned char)(0x80 | fields), 0, 0) || w_key(&w, "v") || w_tag(&w, 1, 0, 0) ||
        w_key(&w, "k") || w_obj(&w, request ? K_REQ : K_REP, NULL, 0, 1) || w_key(&w, "id") ||
        w_obj(&w, id, NULL, 0, 1))
        goto done;
    if (request && (w_key(&w, "svc") || w_obj(&w, service, NULL, 0, 1) || w_key(&w, "op") ||
                    w_obj(&w, op, NULL, 0, 1) || (dl != Py_None && (w_key(&w, "dl") || w_obj(&w, dl, NULL, 0, 1)))))
        goto done;
    if (with_source && (w_key(&w, "src") || w_obj(&w, source, NULL, 0, 1)))
        goto done;
    if (w_key(&w, "a") || w_obj(&w, body, arrays, 1, 0) || w_key(&w, "t") || w_table(&w, arrays, frames))
        goto done;
    PyObject *head = PyBytes_FromStringAndSize(w.buf, w.len);
    if (head == NULL)
        goto done;
    PyList_SET_ITEM(frames, 0, head);
    out = frames;
    frames = NULL;
done:
    if (w.buf != w.small)
        PyMem_Free(w.buf);
    Py_XDECREF(arrays);
    Py_XDECREF(frames);
    if (out == NULL && !PyErr_ExceptionMatches(PyExc_MemoryError)) {
        PyErr_Clear();  /* the Python codec does it, or says why not */
        Py_RETURN_NONE;
    }
    return out;
}

/* reading ---------------------------------------------------------------------------------- */

typedef struct {
    PyObject *box;  /* the list or dict that holds the reference (NULL: the body itself) */
    PyObject *key;  /* its key in a dict (borrowed: the dict holds it) */
    Py_ssize_t at;  /* its index in a list */
    uint32_t index; /* the tensor it names */
} Ref;

typedef struct {
    const unsigned char *p, *end;
    Py_ssize_t cap;
    int max_depth;
    int nrefs;
    Ref refs[MAX_REFS];
} R;

#define NEED(r, n) ((r)->end - (r)->p >= (Py_ssize_t)(n))

static uint64_t be(const unsigned char *p, int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; i++)
        v = (v << 8) | p[i];
    return v;
}

static PyObject *r_obj(R *r, int depth, Ref *ref);

/* a length of ``n`` bytes (n = 0: ``fix``), or -1 */
static Py_ssize_t r_len(R *r, int n, Py_ssize_t fix) {
    if (n == 0)
        return fix;
    if (!NEED(r, n))
        return -1;
    Py_ssize_t len = (Py_ssize_t)be(r->p, n);
    r->p += n;
    return len;
}

static PyObject *r_bytes(R *r, Py_ssize_t n, int str) {
    if (n < 0 || !NEED(r, n))
        return NULL;
    const char *s = (const char *)r->p;
    r->p += n;
    return str ? PyUnicode_DecodeUTF8(s, n, "strict") : PyBytes_FromStringAndSize(s, n);
}

static PyObject *r_list(R *r, Py_ssize_t n, int depth) {
    if (n < 0 || n > r->cap || depth > r->max_depth || !NEED(r, n))  /* each item takes a byte at least */
        return NULL;
    PyObject *list = PyList_New(n);
    if (list == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        Ref ref = {.box = NULL};
        PyObject *v = r_obj(r, depth + 1, &ref);
        if (v == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, v);
        if (ref.box == Py_None) {  /* a tensor reference: patched once the table is read */
            ref.box = list;
            ref.at = i;
            r->refs[r->nrefs - 1] = ref;
        }
    }
    return list;
}

static PyObject *r_map(R *r, Py_ssize_t n, int depth) {
    if (n < 0 || n > r->cap || depth > r->max_depth || !NEED(r, 2 * n))
        return NULL;
    PyObject *d = PyDict_New();
    if (d == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        Ref ref = {.box = NULL};
        PyObject *k = r_obj(r, depth + 1, NULL);
        if (k == NULL || (!PyUnicode_CheckExact(k) && !PyBytes_CheckExact(k))) {  /* strict_map_key */
            Py_XDECREF(k);
            Py_DECREF(d);
            return NULL;
        }
        PyObject *v = r_obj(r, depth + 1, &ref);
        int bad = v == NULL || PyDict_SetItem(d, k, v) || PyDict_GET_SIZE(d) != i + 1;  /* a repeated key */
        Py_DECREF(k);
        Py_XDECREF(v);
        if (bad) {
            Py_DECREF(d);
            return NULL;
        }
        if (ref.box == Py_None) {
            ref.box = d;
            ref.key = k;  /* the dict holds it */
            r->refs[r->nrefs - 1] = ref;
        }
    }
    return d;
}

/* one value; a tensor reference (where ``ref`` is given) reads as None with ref->box = Py_None */
static PyObject *r_obj(R *r, int depth, Ref *ref) {
    if (!NEED(r, 1))
        return NULL;
    unsigned char c = *r->p++;
    if (c <= 0x7f)
        return PyLong_FromLong(c);
    if (c >= 0xe0)
        return PyLong_FromLong((signed char)c);
    if ((c & 0xe0) == 0xa0)
        return r_bytes(r, c & 0x1f, 1);
    if ((c & 0xf0) == 0x90)
        return r_list(r, c & 0x0f, depth);
    if ((c & 0xf0) == 0x80)
        return r_map(r, c & 0x0f, depth);
    static const int width[4] = {1, 2, 4, 8};
    switch (c) {
    case 0xc0:
        Py_RETURN_NONE;
    case 0xc2:
        Py_RETURN_FALSE;
    case 0xc3:
        Py_RETURN_TRUE;
    case 0xc4: case 0xc5: case 0xc6:
        return r_bytes(r, r_len(r, width[c - 0xc4], 0), 0);
    case 0xd9: case 0xda: case 0xdb:
        return r_bytes(r, r_len(r, width[c - 0xd9], 0), 1);
    case 0xdc: case 0xdd:
        return r_list(r, r_len(r, c == 0xdc ? 2 : 4, 0), depth);
    case 0xde: case 0xdf:
        return r_map(r, r_len(r, c == 0xde ? 2 : 4, 0), depth);
    case 0xca: case 0xcb: {
        int n = c == 0xca ? 4 : 8;
        if (!NEED(r, n))
            return NULL;
        uint64_t bits = be(r->p, n);
        r->p += n;
        if (n == 4) {
            uint32_t b32 = (uint32_t)bits;
            float f;
            memcpy(&f, &b32, 4);
            return PyFloat_FromDouble((double)f);
        }
        double d;
        memcpy(&d, &bits, 8);
        return PyFloat_FromDouble(d);
    }
    case 0xcc: case 0xcd: case 0xce: case 0xcf: {
        int n = width[c - 0xcc];
        if (!NEED(r, n))
            return NULL;
        uint64_t v = be(r->p, n);
        r->p += n;
        return PyLong_FromUnsignedLongLong(v);
    }
    case 0xd0: case 0xd1: case 0xd2: case 0xd3: {
        int n = width[c - 0xd0];
        if (!NEED(r, n))
            return NULL;
        uint64_t v = be(r->p, n);
        r->p += n;
        int shift = 64 - 8 * n;  /* sign-extend from n bytes */
        return PyLong_FromLongLong((long long)(v << shift) >> shift);
    }
    case 0xd6:  /* fixext 4: type 1 is a tensor reference, allowed only in the body */
        if (ref == NULL || !NEED(r, 5) || r->p[0] != 1 || r->nrefs == MAX_REFS)
            return NULL;
        ref->box = Py_None;
        ref->index = (uint32_t)be(r->p + 1, 4);
        r->refs[r->nrefs++] = *ref;
        r->p += 5;
        Py_RETURN_NONE;
    default:
        return NULL;  /* other extensions, and 0xc1 */
    }
}

static int limits_of(PyObject *limits) {
    if (limits == LIMITS)
        return 0;
    static const char *names[6] = {"max_header_bytes", "max_frames", "max_container_len", "max_depth",
                                   "max_frame_bytes", "max_message_bytes"};
    long long v[6];
    for (int i = 0; i < 6; i++) {
        PyObject *x = PyObject_GetAttrString(limits, names[i]);
        v[i] = x == NULL ? -1 : PyLong_AsLongLong(x);
        Py_XDECREF(x);
        if (v[i] == -1 && PyErr_Occurred())
            return -1;
    }
    Py_INCREF(limits);
    Py_XSETREF(LIMITS, limits);
    L_HEADER = (Py_ssize_t)v[0];
    L_FRAMES = (Py_ssize_t)v[1];
    L_CONTAINER = (Py_ssize_t)v[2];
    L_DEPTH = (Py_ssize_t)v[3];
    L_FRAME_BYTES = v[4];
    L_MESSAGE_BYTES = v[5];
    return 0;
}

enum { F_V, F_K, F_ID, F_SVC, F_OP, F_DL, F_SRC, F_A, F_T, NFIELDS };
static const char *FIELDS[NFIELDS] = {"v", "k", "id", "svc", "op", "dl", "src", "a", "t"};

/* the header's known fields into ``got`` (new references), or -1 (unknown or repeated, malformed) */
static int r_head(R *r, PyObject **got) {
    if (!NEED(r, 1))
        return -1;
    unsigned char c = *r->p++;
    Py_ssize_t n = (c & 0xf0) == 0x80 ? (c & 0x0f) : c == 0xde ? r_len(r, 2, 0) : c == 0xdf ? r_len(r, 4, 0) : -1;
    if (n < 0 || n > NFIELDS || n > r->cap)
        return -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!NEED(r, 1) || (r->p[0] & 0xe0) != 0xa0)
            return -1;
        size_t len = r->p[0] & 0x1f;
        if (!NEED(r, 1 + len))
            return -1;
        int f = 0;
        while (f < NFIELDS && !(strlen(FIELDS[f]) == len && memcmp(FIELDS[f], r->p + 1, len) == 0))
            f++;
        if (f == NFIELDS || got[f] != NULL)
            return -1;
        r->p += 1 + len;
        Ref ref = {.box = NULL};
        got[f] = r_obj(r, 2, f == F_A ? &ref : NULL);
        if (got[f] == NULL)
            return -1;
        if (ref.box == Py_None)  /* the body is a tensor itself */
            r->refs[r->nrefs - 1].box = NULL;
    }
    return r->p == r->end ? 0 : -1;
}

static int short_str(PyObject *s, Py_ssize_t min) {
    return s != NULL && PyUnicode_CheckExact(s) && PyUnicode_GET_LENGTH(s) >= min && PyUnicode_GET_LENGTH(s) <= MAX_NAME;
}

/* the arrays the table describes, checked as the Python codec checks them, or NULL */
static PyObject *r_tensors(PyObject *table, PyObject *frames, Py_ssize_t nframes) {
    if (table == NULL)
        return nframes == 1 ? PyList_New(0) : NULL;
    if (!PyList_CheckExact(table) || PyList_GET_SIZE(table) != nframes - 1)
        return NULL;
    PyObject *arrays = PyList_New(nframes - 1);
    char seen[MAX_REFS + 1] = {0};
    long long total = 0;
    if (arrays == NULL || nframes - 1 > MAX_REFS) {
        Py_XDECREF(arrays);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < nframes - 1; i++) {
        PyObject *e = PyList_GET_ITEM(table, i);
        if (!PyList_CheckExact(e) || PyList_GET_SIZE(e) != 3)
            goto fail;
        PyObject *name = PyList_GET_ITEM(e, 0), *shape = PyList_GET_ITEM(e, 1), *at = PyList_GET_ITEM(e, 2);
        PyObject *dtype = PyUnicode_CheckExact(name) ? PyDict_GetItemWithError(DTYPES, name) : NULL;
        if (dtype == NULL || !PyList_CheckExact(shape) || PyList_GET_SIZE(shape) > MAX_NDIM || !PyLong_CheckExact(at))
            goto fail;
        long index = PyLong_AsLong(at);
        if (index < 1 || index >= nframes || seen[index])
            goto fail;
        seen[index] = 1;
        PyObject *itemsize = PyObject_GetAttr(dtype, S_ITEMSIZE);
        long long expected = itemsize == NULL ? -1 : PyLong_AsLongLong(itemsize);
        Py_XDECREF(itemsize);
        if (expected < 0)
            goto fail;
        for (Py_ssize_t d = 0; d < PyList_GET_SIZE(shape); d++) {
            PyObject *dim = PyList_GET_ITEM(shape, d);
            long long v = PyLong_CheckExact(dim) ? PyLong_AsLongLong(dim) : -1;
            if (v < 0 || __builtin_mul_overflow(expected, v, &expected))
                goto fail;
        }
        PyObject *frame = PyList_GET_ITEM(frames, index);
        Py_buffer view;
        if (PyObject_GetBuffer(frame, &view, PyBUF_SIMPLE))
            goto fail;
        long long nbytes = view.len;
        PyBuffer_Release(&view);
        total += nbytes;
        if (nbytes > L_FRAME_BYTES || total > L_MESSAGE_BYTES || nbytes != expected)
            goto fail;
        PyObject *mv = PyMemoryView_FromObject(frame);
        PyObject *arr = mv == NULL ? NULL : PyObject_CallFunctionObjArgs(FROMBUFFER, mv, dtype, NULL);
        Py_XDECREF(mv);
        if (arr != NULL && PyList_GET_SIZE(shape) != 1)
            Py_SETREF(arr, PyObject_CallMethodOneArg(arr, S_RESHAPE, shape));
        if (arr == NULL)
            goto fail;
        PyList_SET_ITEM(arrays, i, arr);
    }
    return arrays;
fail:
    Py_DECREF(arrays);
    return NULL;
}

/* every reference replaced by its array; each array referenced at least once */
static int resolve(R *r, PyObject *arrays, PyObject **body) {
    Py_ssize_t n = PyList_GET_SIZE(arrays);
    char used[MAX_REFS] = {0};
    for (int i = 0; i < r->nrefs; i++) {
        Ref *ref = &r->refs[i];
        if (ref->index >= n)
            return -1;
        used[ref->index] = 1;
        PyObject *arr = PyList_GET_ITEM(arrays, ref->index);
        if (ref->box == NULL) {
            Py_INCREF(arr);
            Py_SETREF(*body, arr);
        } else if (PyList_CheckExact(ref->box)) {
            Py_INCREF(arr);
            PyList_SetItem(ref->box, ref->at, arr);
        } else if (PyDict_SetItem(ref->box, ref->key, arr)) {
            return -1;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (!used[i])
            return -1;
    return 0;
}

static PyObject *decode(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "decode takes 2 arguments");
        return NULL;
    }
    if (!PyList_CheckExact(args[0]))
        Py_RETURN_NONE;
    PyObject *frames = args[0];
    Py_ssize_t nframes = PyList_GET_SIZE(frames);
    if (limits_of(args[1]))
        return NULL;
    if (nframes < 1 || nframes > L_FRAMES)
        Py_RETURN_NONE;
    Py_buffer hv;
    if (PyObject_GetBuffer(PyList_GET_ITEM(frames, 0), &hv, PyBUF_SIMPLE)) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    PyObject *got[NFIELDS] = {NULL};
    PyObject *arrays = NULL, *out = NULL;
    R r = {.p = hv.buf, .end = (const unsigned char *)hv.buf + hv.len, .cap = L_CONTAINER, .nrefs = 0};
    r.max_depth = L_DEPTH < MAX_DEPTH ? (int)L_DEPTH : MAX_DEPTH;
    if (hv.len > L_HEADER || r_head(&r, got))
        goto done;
    PyObject *v = got[F_V], *k = got[F_K], *id = got[F_ID], *dl = got[F_DL], *src = got[F_SRC];
    if (v == NULL || !PyLong_CheckExact(v) || PyLong_AsLong(v) != 1 || k == NULL || !PyUnicode_CheckExact(k) ||
        id == NULL || !PyLong_CheckExact(id) || (PyLong_AsUnsignedLongLong(id) == (unsigned long long)-1 && PyErr_Occurred()))
        goto done;
    int request = PyUnicode_Compare(k, K_REQ) == 0;
    if (!request && PyUnicode_Compare(k, K_REP) != 0)
        goto done;  /* an error, or not a kind at all */
    if (src != NULL && !short_str(src, 0))
        goto done;
    if (request) {
        if (!short_str(got[F_SVC], 1) || !short_str(got[F_OP], 1))
            goto done;
        if (dl != NULL && dl != Py_None) {
            double d = PyFloat_CheckExact(dl) ? PyFloat_AS_DOUBLE(dl) : PyLong_CheckExact(dl) ? PyLong_AsDouble(dl) : -1.0;
            if (d == -1.0 && PyErr_Occurred())
                goto done;
            if (!(d > 0.0 && d < INFINITY))
                goto done;
            Py_SETREF(got[F_DL], PyFloat_FromDouble(d));
            if (got[F_DL] == NULL)
                goto done;
        }
    } else if (got[F_SVC] != NULL || got[F_OP] != NULL || dl != NULL) {
        goto done;
    }
    arrays = r_tensors(got[F_T], frames, nframes);
    if (arrays == NULL)
        goto done;
    PyObject *body = got[F_A] != NULL ? got[F_A] : Py_None;
    Py_INCREF(body);
    if (resolve(&r, arrays, &body)) {
        Py_DECREF(body);
        goto done;
    }
    PyObject *none = Py_None;
    PyObject *dlv = request && got[F_DL] != NULL ? got[F_DL] : none;
    out = PyObject_CallFunctionObjArgs(MESSAGE, request ? K_REQ : K_REP, id, request ? got[F_SVC] : EMPTY,
                                       request ? got[F_OP] : EMPTY, body, dlv, src != NULL ? src : EMPTY, NULL);
    Py_DECREF(body);
done:
    PyBuffer_Release(&hv);
    for (int i = 0; i < NFIELDS; i++)
        Py_XDECREF(got[i]);
    Py_XDECREF(arrays);
    if (out == NULL) {
        if (PyErr_Occurred() && PyErr_ExceptionMatches(PyExc_MemoryError))
            return NULL;
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    return out;
}

static PyObject *configure(PyObject *self, PyObject *args) {
    PyObject *o[9];
    if (!PyArg_ParseTuple(args, "UUOOO!OOOO", &o[0], &o[1], &o[2], &o[3], &PyDict_Type, &o[4], &o[5], &o[6], &o[7], &o[8]))
        return NULL;
    PyObject **slots[9] = {&K_REQ, &K_REP, &MESSAGE, &FROMBUFFER, &DTYPES, &NDARRAY, &EXTTYPE, &EXTRACT, &WIRE_BUFFER};
    for (int i = 0; i < 9; i++) {
        Py_INCREF(o[i]);
        Py_XSETREF(*slots[i], o[i]);
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"configure", configure, METH_VARARGS, "Set the kinds, classes and hooks the fast path uses."},
    {"encode", (PyCFunction)(void (*)(void))encode, METH_FASTCALL, "Frames of a request or reply, or None."},
    {"decode", (PyCFunction)(void (*)(void))decode, METH_FASTCALL, "A request or reply Message, or None."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "codec_c", NULL, -1, methods};

PyMODINIT_FUNC PyInit_codec_c(void) {
    EMPTY = PyUnicode_FromString("");
    S_ITEMSIZE = PyUnicode_InternFromString("itemsize");
    S_RESHAPE = PyUnicode_InternFromString("reshape");
    S_SHAPE = PyUnicode_InternFromString("shape");
    if (EMPTY == NULL || S_ITEMSIZE == NULL || S_RESHAPE == NULL || S_SHAPE == NULL)
        return NULL;
    return PyModule_Create(&module);
}
