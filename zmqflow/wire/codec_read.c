/* The compiled codec's reader: a request or reply read and checked as the Python codec checks it,
   or None for anything it does not take. See codec_c.c. */

#include "codec_c.h"

/* a Limits' values, copied for one decode: another thread may decode with other limits
   whenever this one runs Python code (an array built, the Message made) */
typedef struct {
    long long header, frames, container, depth, frame_bytes, message_bytes;
} Lim;

static PyObject *LIMITS;  /* the Limits last read, and its values */
static Lim CACHED;

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
    int nrefs, cap_refs;
    Ref *refs;  /* ``inline_refs`` until more are read, then a block of the heap */
    Ref inline_refs[INLINE_REFS];
} R;

/* room for one more reference (doubled on the heap when full), or -1 past MAX_REFS or out of memory */
static int r_room(R *r) {
    if (r->nrefs < r->cap_refs)
        return 0;
    if (r->cap_refs >= MAX_REFS)
        return -1;
    int cap = r->cap_refs * 2 < MAX_REFS ? r->cap_refs * 2 : MAX_REFS;
    Ref *grown = PyMem_Malloc((size_t)cap * sizeof(Ref));
    if (grown == NULL)
        return -1;
    memcpy(grown, r->refs, (size_t)r->nrefs * sizeof(Ref));
    if (r->refs != r->inline_refs)
        PyMem_Free(r->refs);
    r->refs = grown;
    r->cap_refs = cap;
    return 0;
}

#define NEED(r, n) ((r)->end - (r)->p >= (Py_ssize_t)(n))

static uint64_t be(const unsigned char *p, int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; i++)
        v = (v << 8) | p[i];
    return v;
}

static PyObject *r_obj(R *r, int depth, Ref *ref);

/* the next ``n`` bytes as a big-endian number; -1 when fewer are left */
static int r_be(R *r, int n, uint64_t *v) {
    if (!NEED(r, n))
        return -1;
    *v = be(r->p, n);
    r->p += n;
    return 0;
}

/* a length of ``n`` bytes (n = 0: ``fix``), or -1 */
static Py_ssize_t r_len(R *r, int n, Py_ssize_t fix) {
    uint64_t len;
    if (n == 0)
        return fix;
    return r_be(r, n, &len) ? -1 : (Py_ssize_t)len;
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
        uint64_t bits;
        if (r_be(r, n, &bits))
            return NULL;
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
    case 0xcc: case 0xcd: case 0xce: case 0xcf:
    case 0xd0: case 0xd1: case 0xd2: case 0xd3: {
        int n = width[(c - 0xcc) & 3];
        uint64_t v;
        if (r_be(r, n, &v))
            return NULL;
        if (c <= 0xcf)
            return PyLong_FromUnsignedLongLong(v);
        int shift = 64 - 8 * n;  /* sign-extend from n bytes */
        return PyLong_FromLongLong((long long)(v << shift) >> shift);
    }
    case 0xd6:  /* fixext 4: type 1 is a tensor reference, allowed only in the body */
        if (ref == NULL || !NEED(r, 5) || r->p[0] != 1 || r_room(r))
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

/* ``limits``' values, each clamped to a long long (a bound past that range compares with every
   size here as the Python int does); 1 when one is not an int, or a header or container bound is
   past that range (the Python codec then decides), -1 with an error set when memory ran out */
static int limits_of(PyObject *limits, Lim *out) {
    if (limits == LIMITS) {
        *out = CACHED;
        return 0;
    }
    static const char *names[6] = {"max_header_bytes", "max_frames", "max_container_len", "max_depth",
                                   "max_frame_bytes", "max_message_bytes"};
    long long v[6];
    for (int i = 0; i < 6; i++) {
        PyObject *x = PyObject_GetAttrString(limits, names[i]);
        int overflow = 0;
        v[i] = x == NULL ? -1 : PyLong_AsLongLongAndOverflow(x, &overflow);
        Py_XDECREF(x);
        if (v[i] == -1 && PyErr_Occurred()) {
            if (PyErr_ExceptionMatches(PyExc_MemoryError))
                return -1;
            PyErr_Clear();
            return 1;
        }
        if (overflow && (i == 0 || i == 2))
            return 1;  /* msgpack takes these as a Py_ssize_t and refuses more: the Python codec decides */
        if (overflow)
            v[i] = overflow > 0 ? LLONG_MAX : LLONG_MIN;
    }
    *out = (Lim){v[0], v[1], v[2], v[3], v[4], v[5]};
    CACHED = *out;  /* the values first: dropping the old Limits may run Python code */
    Py_INCREF(limits);
    Py_XSETREF(LIMITS, limits);
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

/* the arrays the table describes, checked as the Python codec checks them (tensors.read), or NULL */
static PyObject *r_tensors(PyObject *table, PyObject *frames, Py_ssize_t nframes, const Lim *lim) {
    if (table == NULL)
        return nframes == 1 ? PyList_New(0) : NULL;
    if (!PyList_CheckExact(table) || PyList_GET_SIZE(table) > MAX_REFS)
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(table);
    PyObject *arrays = PyList_New(n);
    char few[INLINE_REFS + 1] = {0};  /* 1: a frame of one array, 2: a pack; on the heap past INLINE_REFS */
    char *seen = nframes <= INLINE_REFS + 1 ? few : PyMem_Calloc((size_t)nframes, 1);
    long long total = 0, last_frame = 0, last_end = 0;  /* where the last packed array ended */
    if (arrays == NULL || seen == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *e = PyList_GET_ITEM(table, i);
        if (!PyList_CheckExact(e) || PyList_GET_SIZE(e) < 3 || PyList_GET_SIZE(e) > 4)
            goto fail;
        int packed = PyList_GET_SIZE(e) == 4;
        PyObject *name = PyList_GET_ITEM(e, 0), *shape = PyList_GET_ITEM(e, 1), *at = PyList_GET_ITEM(e, 2);
        PyObject *off = packed ? PyList_GET_ITEM(e, 3) : NULL;
        PyObject *dtype = PyUnicode_CheckExact(name) ? PyDict_GetItemWithError(DTYPES, name) : NULL;
        if (dtype == NULL || !PyList_CheckExact(shape) || PyList_GET_SIZE(shape) > MAX_NDIM || !PyLong_CheckExact(at) ||
            (packed && !PyLong_CheckExact(off)))
            goto fail;
        long index = PyLong_AsLong(at);
        if (index < 1 || index >= nframes || seen[index] == 1 || (seen[index] && !packed))
            goto fail;
        PyObject *itemsize = PyObject_GetAttr(dtype, S_ITEMSIZE);
        long long item = itemsize == NULL ? -1 : PyLong_AsLongLong(itemsize), expected = item;
        Py_XDECREF(itemsize);
        if (item <= 0)
            goto fail;
        for (Py_ssize_t d = 0; d < PyList_GET_SIZE(shape); d++) {
            PyObject *dim = PyList_GET_ITEM(shape, d);
            long long v = PyLong_CheckExact(dim) ? PyLong_AsLongLong(dim) : -1;
            if (v < 0 || __builtin_mul_overflow(expected, v, &expected))
                goto fail;
        }
        long long offset = packed ? PyLong_AsLongLong(off) : 0;
        if (packed && (offset < 0 || offset % item || index < last_frame || (index == last_frame && offset < last_end)))
            goto fail;
        PyObject *frame = PyList_GET_ITEM(frames, index);
        Py_buffer view;
        if (PyObject_GetBuffer(frame, &view, PyBUF_SIMPLE))
            goto fail;
        long long nbytes = view.len;
        PyBuffer_Release(&view);
        if (!seen[index]) {
            total += nbytes;
            if (nbytes > lim->frame_bytes || total > lim->message_bytes)
                goto fail;
            seen[index] = packed ? 2 : 1;
        }
        long long end;
        if (packed ? __builtin_add_overflow(offset, expected, &end) || end > nbytes : nbytes != expected)
            goto fail;
        if (packed) {
            last_frame = index;
            last_end = end;
        }
        /* ndarray(shape, dtype, frame[, offset]): one call where frombuffer and a reshape took
           three, the frame itself its base (read-only when the frame is) */
        PyObject *arr;
        if (packed)
            arr = PyObject_CallFunctionObjArgs(NDARRAY, shape, dtype, frame, off, NULL);
        else
            arr = PyObject_CallFunctionObjArgs(NDARRAY, shape, dtype, frame, NULL);
        if (arr == NULL)
            goto fail;
        PyList_SET_ITEM(arrays, i, arr);
    }
    for (Py_ssize_t k = 1; k < nframes; k++)
        if (!seen[k])
            goto fail;
    if (seen != few)
        PyMem_Free(seen);
    return arrays;
fail:
    if (seen != NULL && seen != few)
        PyMem_Free(seen);
    Py_XDECREF(arrays);
    return NULL;
}

/* a Message of ``values`` (its fields in order): its slots set on a new instance, without its
   Python __init__; the class called where its slots were not found */
static PyObject *new_message(PyObject **values) {
    if (MSG_FIELDS[0] == NULL)
        return PyObject_CallFunctionObjArgs(MESSAGE, values[0], values[1], values[2], values[3], values[4], values[5],
                                            values[6], NULL);
    PyTypeObject *t = (PyTypeObject *)MESSAGE;
    PyObject *m = t->tp_alloc(t, 0);
    if (m == NULL)
        return NULL;
    for (int i = 0; i < MSG_NFIELDS; i++) {
        if (Py_TYPE(MSG_FIELDS[i])->tp_descr_set(MSG_FIELDS[i], m, values[i]) < 0) {
            Py_DECREF(m);
            return NULL;
        }
    }
    return m;
}

/* every reference replaced by its array; each array referenced at least once */
static int resolve(R *r, PyObject *arrays, PyObject **body) {
    Py_ssize_t n = PyList_GET_SIZE(arrays);
    char few[INLINE_REFS] = {0};  /* which arrays are referenced; on the heap past INLINE_REFS */
    char *used = n <= INLINE_REFS ? few : PyMem_Calloc((size_t)n, 1);
    int bad = used == NULL;
    for (int i = 0; i < r->nrefs && !bad; i++) {
        Ref *ref = &r->refs[i];
        if (ref->index >= n) {
            bad = 1;
            break;
        }
        used[ref->index] = 1;
        PyObject *arr = PyList_GET_ITEM(arrays, ref->index);
        if (ref->box == NULL) {
            Py_INCREF(arr);
            Py_SETREF(*body, arr);
        } else if (PyList_CheckExact(ref->box)) {
            Py_INCREF(arr);
            PyList_SetItem(ref->box, ref->at, arr);
        } else if (PyDict_SetItem(ref->box, ref->key, arr)) {
            bad = 1;
        }
    }
    for (Py_ssize_t i = 0; i < n && !bad; i++)
        bad = !used[i];
    if (used != NULL && used != few)
        PyMem_Free(used);
    return bad ? -1 : 0;
}

PyObject *codec_decode(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "decode takes 2 arguments");
        return NULL;
    }
    if (!PyList_CheckExact(args[0]))
        Py_RETURN_NONE;
    PyObject *frames = args[0];
    Py_ssize_t nframes = PyList_GET_SIZE(frames);
    Lim lim;
    int taken = limits_of(args[1], &lim);
    if (taken)
        return taken < 0 ? NULL : Py_NewRef(Py_None);
    if (nframes < 1 || nframes > lim.frames)
        Py_RETURN_NONE;
    Py_buffer hv;
    if (PyObject_GetBuffer(PyList_GET_ITEM(frames, 0), &hv, PyBUF_SIMPLE)) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    PyObject *got[NFIELDS] = {NULL};
    PyObject *arrays = NULL, *out = NULL;
    R r = {.p = hv.buf, .end = (const unsigned char *)hv.buf + hv.len, .nrefs = 0, .cap_refs = INLINE_REFS};
    r.refs = r.inline_refs;
    r.cap = lim.container < PY_SSIZE_T_MAX ? (Py_ssize_t)lim.container : PY_SSIZE_T_MAX;
    r.max_depth = lim.depth < 0 ? 0 : lim.depth < MAX_DEPTH ? (int)lim.depth : MAX_DEPTH;  /* negative as 0 */
    if (hv.len > lim.header || r_head(&r, got))
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
    arrays = r_tensors(got[F_T], frames, nframes, &lim);
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
    PyObject *values[MSG_NFIELDS] = {request ? K_REQ : K_REP, id, request ? got[F_SVC] : EMPTY,
                                     request ? got[F_OP] : EMPTY, body, dlv, src != NULL ? src : EMPTY, none};
    out = new_message(values);
    Py_DECREF(body);
done:
    if (r.refs != r.inline_refs)
        PyMem_Free(r.refs);
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
