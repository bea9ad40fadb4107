/* The compiled codec's writer: a request or reply as msgpack, byte for byte what the Python
   codec's Packer writes (use_bin_type, doubles, the smallest integer forms). See codec_c.c. */

#include "codec_c.h"

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

static int w_struct(W *w, PyObject *o, PyObject *layout, PyObject *arrays, int depth);
static PyObject *layout_of(PyObject *o);

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
        Py_ssize_t n = PyDict_GET_SIZE(o), pos = 0, count = 0;
        if (w_len(w, n, 0x80, 16, 0, 0xde, 0xdf))
            return -1;
        PyObject *k, *v;
        while (PyDict_Next(o, &pos, &k, &v)) {
            Py_INCREF(k);
            Py_INCREF(v);
            int r = w_obj(w, k, NULL, depth + 1, 1) || w_obj(w, v, arrays, depth + 1, hooked);
            Py_DECREF(k);
            Py_DECREF(v);
            if (r)
                return -1;
            count++;
        }
        if (count != n || PyDict_GET_SIZE(o) != n) {  /* changed by a hook: the size written is wrong */
            PyErr_SetString(PyExc_RuntimeError, "a dict changed size while it was written");
            return -1;
        }
        return 0;
    }
    if (t == &PyList_Type || t == &PyTuple_Type) {
        /* a hook (an isinstance check, _extract, a field's __ne__) may change a list as it is
           written: its size is checked at every item, and each item held while it is written */
        Py_ssize_t n = Py_SIZE(o);
        int r = w_len(w, n, 0x90, 16, 0, 0xdc, 0xdd);
        for (Py_ssize_t i = 0; !r && i < n; i++) {
            if (Py_SIZE(o) != n) {
                PyErr_SetString(PyExc_RuntimeError, "a list changed size while it was written");
                r = -1;
                break;
            }
            PyObject *item = t == &PyList_Type ? PyList_GET_ITEM(o, i) : PyTuple_GET_ITEM(o, i);
            Py_INCREF(item);
            r = w_obj(w, item, arrays, depth + 1, hooked);
            Py_DECREF(item);
        }
        if (!r && Py_SIZE(o) != n) {  /* grown by the last item's hook: the length written is wrong */
            PyErr_SetString(PyExc_RuntimeError, "a list changed size while it was written");
            r = -1;
        }
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
    PyObject *layout = layout_of(o);  /* borrowed from the cache: held while a hook may run */
    if (layout != NULL) {
        Py_INCREF(layout);
        int r = w_struct(w, o, layout, arrays, depth);
        Py_DECREF(layout);
        return r;
    }
    if (PyErr_Occurred())
        return -1;
    PyObject *x = PyObject_CallFunctionObjArgs(EXTRACT, o, arrays, NULL);
    if (x == NULL)
        return -1;
    int r = w_obj(w, x, arrays, depth, 1);
    Py_DECREF(x);
    return r;
}

#define MAX_FIELDS 64

/* ``v != d`` as Python evaluates it (structs._sent): no identity shortcut, so a field holding its
   own NaN default is sent, as the Python codec sends it. The shortcut is kept where ``==`` is
   known to be reflexive (int, str, bool): the common defaults. 1, 0, or -1 with an error set. */
static int differs(PyObject *v, PyObject *d) {
    if (v == d && (PyLong_CheckExact(v) || PyUnicode_CheckExact(v) || PyBool_Check(v)))
        return 0;
    PyObject *ne = PyObject_RichCompare(v, d, Py_NE);
    if (ne == NULL)
        return -1;
    int s = ne == Py_True ? 1 : ne == Py_False ? 0 : PyObject_IsTrue(ne);
    Py_DECREF(ne);
    return s;
}

/* a declared request (map of the fields that differ from their defaults) or item (list of its
   fields), as the codec's _extract writes it; ``layout`` is (array_like, names, defaults) */
static int w_struct(W *w, PyObject *o, PyObject *layout, PyObject *arrays, int depth) {
    int array_like = PyTuple_GET_ITEM(layout, 0) == Py_True;
    PyObject *names = PyTuple_GET_ITEM(layout, 1), *defaults = PyTuple_GET_ITEM(layout, 2);
    Py_ssize_t n = PyTuple_GET_SIZE(names), count = 0;
    PyObject *vals[MAX_FIELDS];
    char sent[MAX_FIELDS];
    if (n > MAX_FIELDS) {
        PyErr_SetString(PyExc_ValueError, "fields");
        return -1;
    }
    Py_ssize_t got = 0;
    int r = 0;
    for (; got < n; got++) {
        PyObject *v = vals[got] = PyObject_GetAttr(o, PyTuple_GET_ITEM(names, got));
        PyObject *d = PyTuple_GET_ITEM(defaults, got);
        if (v == NULL) {
            r = -1;
            break;
        }
        int s = 1;
        if (!array_like && d != REQUIRED)
            s = d == Py_None ? v != Py_None : Py_TYPE(v) != Py_TYPE(d) ? 1 : differs(v, d);
        if (s < 0) {
            got++;
            r = -1;
            break;
        }
        sent[got] = (char)s;
        count += s;
    }
    if (!r)
        r = array_like ? w_len(w, n, 0x90, 16, 0, 0xdc, 0xdd) : w_len(w, count, 0x80, 16, 0, 0xde, 0xdf);
    for (Py_ssize_t i = 0; !r && i < n; i++)
        if (sent[i])
            r = (!array_like && w_str(w, PyTuple_GET_ITEM(names, i))) || w_obj(w, vals[i], arrays, depth + 1, 0);
    for (Py_ssize_t i = 0; i < got; i++)
        Py_XDECREF(vals[i]);
    return r;
}

/* the layout of a Struct's type (cached), NULL (no error) for any other value */
static PyObject *layout_of(PyObject *o) {
    PyObject *t = (PyObject *)Py_TYPE(o);
    PyObject *layout = PyDict_GetItemWithError(LAYOUTS, t);
    if (layout != NULL || PyErr_Occurred())
        return layout;
    int is = PyObject_IsInstance(o, STRUCT);
    if (is <= 0)
        return NULL;
    layout = PyObject_CallOneArg(LAYOUT, t);
    if (layout == NULL)
        return NULL;
    int bad = !PyTuple_CheckExact(layout) || PyTuple_GET_SIZE(layout) != 3 || !PyTuple_CheckExact(PyTuple_GET_ITEM(layout, 1)) ||
              !PyTuple_CheckExact(PyTuple_GET_ITEM(layout, 2)) ||
              PyTuple_GET_SIZE(PyTuple_GET_ITEM(layout, 1)) != PyTuple_GET_SIZE(PyTuple_GET_ITEM(layout, 2));
    if (bad || PyDict_SetItem(LAYOUTS, t, layout)) {
        if (bad)
            PyErr_SetString(PyExc_TypeError, "layout");
        Py_DECREF(layout);
        return NULL;
    }
    Py_DECREF(layout);  /* the cache holds it */
    return layout;
}

static int w_key(W *w, const char *key) {
    size_t n = strlen(key);
    return w_tag(w, (unsigned char)(0xa0 | n), 0, 0) || w_put(w, key, (Py_ssize_t)n);
}

/* (arr, wire name) for an ndarray sent as it is (C-ordered, of a dtype in AS_IS): what the codec's
   _wire_buffer answers for it, without the call; NULL without an error for anything else */
static PyObject *as_is(PyObject *arr) {
    if (Py_TYPE(arr) != (PyTypeObject *)NDARRAY)
        return NULL;
    PyObject *dt = PyObject_GetAttr(arr, S_DTYPE);
    PyObject *name = dt == NULL ? NULL : PyDict_GetItemWithError(AS_IS, dt);  /* borrowed */
    Py_XDECREF(dt);
    if (name == NULL)
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(arr, &view, PyBUF_C_CONTIGUOUS) < 0) {  /* not C-ordered: _wire_buffer copies */
        PyErr_Clear();
        return NULL;
    }
    PyBuffer_Release(&view);
    return PyTuple_Pack(2, arr, name);
}

/* one table entry: [name, shape, frame] or, packed, [name, shape, frame, offset] */
static int w_entry(W *w, PyObject *arr, PyObject *name, Py_ssize_t frame, Py_ssize_t offset) {
    PyObject *shape = PyObject_GetAttr(arr, S_SHAPE);
    int r = shape == NULL || w_tag(w, offset < 0 ? 0x93 : 0x94, 0, 0) || w_obj(w, name, NULL, 0, 1) ||
            w_obj(w, shape, NULL, 0, 1);
    Py_XDECREF(shape);
    for (int k = 0; k < 2 && !r; k++) {
        Py_ssize_t v = k == 0 ? frame : offset;
        if (v < 0)
            break;
        PyObject *at = PyLong_FromSsize_t(v);
        r = at == NULL || w_int(w, at);
        Py_XDECREF(at);
    }
    if (r && !PyErr_Occurred())
        PyErr_SetString(PyExc_TypeError, "table");
    return r ? -1 : 0;
}

/* the tensor table, and the frames after the header appended to ``frames``: as tensors.write,
   byte for byte (the arrays sent whole, in order, then the packs of the small ones) */
static int w_table(W *w, PyObject *arrays, PyObject *frames) {
    Py_ssize_t n = PyList_GET_SIZE(arrays), small = 0, whole = 0, npacks = 1;
    if (w_len(w, n, 0x90, 16, 0, 0xdc, 0xdd))
        return -1;
    PyObject *pairs = PyList_New(n);  /* (buffer, wire name) of each array */
    Py_ssize_t *place = PyMem_Calloc((size_t)n + 1, 2 * sizeof(Py_ssize_t));  /* (pack, offset); -1: whole */
    Py_ssize_t *sizes = PyMem_Calloc((size_t)n + 1, sizeof(Py_ssize_t));  /* of each pack */
    PyObject *packs = NULL;
    int r = -1;
    if (pairs == NULL || place == NULL || sizes == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *arr = PyList_GET_ITEM(arrays, i);
        PyObject *pair = as_is(arr);
        if (pair == NULL && !PyErr_Occurred())
            pair = PyObject_CallOneArg(WIRE_BUFFER, arr);
        if (pair == NULL)
            goto done;
        PyList_SET_ITEM(pairs, i, pair);
        Py_buffer view;
        if (!PyTuple_CheckExact(pair) || PyTuple_GET_SIZE(pair) != 2 ||
            PyObject_GetBuffer(PyTuple_GET_ITEM(pair, 0), &view, PyBUF_C_CONTIGUOUS) < 0) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError, "table");
            goto done;
        }
        place[2 * i] = view.len > 0 && view.len < PACK_BELOW ? view.len : -1;  /* its bytes, for now */
        small += place[2 * i] > 0;
        PyBuffer_Release(&view);
    }
    for (Py_ssize_t i = 0; i < n; i++) {  /* where each small one goes, as tensors.write places them */
        Py_ssize_t len = place[2 * i];
        if (small < 2 || len < 0) {
            place[2 * i] = -1;
            continue;
        }
        Py_ssize_t offset = (sizes[npacks - 1] + PACK_ALIGN - 1) / PACK_ALIGN * PACK_ALIGN;
        if (offset + len > PACK_BYTES) {
            npacks++;
            offset = 0;
        }
        place[2 * i] = npacks - 1;
        place[2 * i + 1] = offset;
        sizes[npacks - 1] = offset + len;
    }
    Py_ssize_t first_pack = 1 + n - (small < 2 ? 0 : small);
    if (small >= 2 && (packs = PyList_New(npacks)) == NULL)
        goto done;
    for (Py_ssize_t k = 0; packs != NULL && k < npacks; k++) {
        PyObject *pack = PyByteArray_FromStringAndSize(NULL, sizes[k]);
        if (pack == NULL)
            goto done;
        memset(PyByteArray_AS_STRING(pack), 0, (size_t)sizes[k]);
        PyList_SET_ITEM(packs, k, pack);
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *arr = PyList_GET_ITEM(arrays, i), *pair = PyList_GET_ITEM(pairs, i);
        PyObject *buf = PyTuple_GET_ITEM(pair, 0), *name = PyTuple_GET_ITEM(pair, 1);
        if (place[2 * i] < 0) {
            if (PyList_Append(frames, buf) || w_entry(w, arr, name, ++whole, -1))
                goto done;
            continue;
        }
        Py_buffer view;
        if (PyObject_GetBuffer(buf, &view, PyBUF_C_CONTIGUOUS) < 0)
            goto done;
        PyObject *pack = PyList_GET_ITEM(packs, place[2 * i]);
        memcpy(PyByteArray_AS_STRING(pack) + place[2 * i + 1], view.buf, (size_t)view.len);
        PyBuffer_Release(&view);
        if (w_entry(w, arr, name, first_pack + place[2 * i], place[2 * i + 1]))
            goto done;
    }
    for (Py_ssize_t k = 0; packs != NULL && k < npacks; k++)
        if (PyList_Append(frames, PyList_GET_ITEM(packs, k)))
            goto done;
    r = 0;
done:
    Py_XDECREF(pairs);
    Py_XDECREF(packs);
    PyMem_Free(place);
    PyMem_Free(sizes);
    return r;
}

PyObject *codec_encode(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
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
