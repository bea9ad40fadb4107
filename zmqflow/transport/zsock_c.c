/* A channel's socket calls in C: libzmq called straight, on the handle pyzmq exposes
   (Socket.underlying), skipping pyzmq's per-call Python work (option enums, a Frame object and an
   exception per empty receive). The libzmq is the one pyzmq's own backend module is linked to,
   found through that module's handle, so both act on the same sockets.

   load(backend_path, zmq_error, ndarray) -> (major, minor, patch)
       once, from zmqflow/transport/sockops.py: resolves libzmq through pyzmq's backend module.
   events(handle)                  -> ZMQ_EVENTS, or -errno
   recv(handle, copied, release[, max_parts])
                                   -> [frames] | None (nothing waiting): the first ``copied`` parts
                                      as bytes, the rest as zero-copy Msg objects; parts past
                                      ``max_parts`` are read and dropped (a peer's message of very
                                      many tiny parts costs no object each)
   send(handle, threshold, frames) -> frames sent: all of them, or -1 (the first was refused with
                                      EAGAIN: nothing sent), or k: frame k is no contiguous buffer,
                                      and the caller sends it and the rest with pyzmq. Frames under
                                      ``threshold`` bytes are copied; a received Msg (or an array
                                      over exactly its bytes) goes out sharing libzmq's message;
                                      any other buffer goes out zero-copy, lent (zsock_buffers.c).
   collect()                       -> let go of lent buffers libzmq is done with (every call
                                      above does it first); how many are still lent

   ``release``: the socket's peers may be in this process (inproc), so a shared part is closed with
   the GIL let go (see zsock_c.h). Any other failure raises zmq.ZMQError(errno). The caller keeps the
   socket open while it calls here; nothing here holds the handle. */

#include "zsock_c.h"

#include <dlfcn.h>
#include <time.h>

int (*z_getsockopt)(void *, int, void *, size_t *);
int (*z_msg_init)(zmsg *);
int (*z_msg_init_data)(zmsg *, void *, size_t, void (*)(void *, void *), void *);
int (*z_msg_recv)(zmsg *, void *, int);
int (*z_msg_send)(zmsg *, void *, int);
int (*z_msg_close)(zmsg *);
int (*z_msg_copy)(zmsg *, zmsg *);
int (*z_msg_move)(zmsg *, zmsg *);
void *(*z_msg_data)(zmsg *);
size_t (*z_msg_size)(const zmsg *);
int (*z_msg_more)(const zmsg *);
int (*z_msg_get)(const zmsg *, int);
int (*z_send)(void *, const void *, size_t, int);
int (*z_errno)(void);
void (*z_version)(int *, int *, int *);

static PyObject *ZMQ_ERROR;
PyObject *NDARRAY, *S_BASE;
static int LOADED;

static long long LAST_RELEASE;

int release_due(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    long long now = (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
    if (now - LAST_RELEASE < RELEASE_EVERY_NS)
        return 0;
    LAST_RELEASE = now; /* read and written with the GIL held */
    return 1;
}

/* ---- helpers --------------------------------------------------------------------------------- */

static PyObject *raise_zmq(int err) {
    PyObject *exc = PyObject_CallFunction(ZMQ_ERROR, "i", err);
    if (exc != NULL) {
        PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
        Py_DECREF(exc);
    }
    return NULL;
}

static int not_loaded(void) {
    if (!LOADED)
        PyErr_SetString(PyExc_RuntimeError, "zsock_c.load() has not run");
    return !LOADED;
}

static int handle_of(PyObject *obj, void **out) {
    *out = PyLong_AsVoidPtr(obj);
    if (*out == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "socket handle is NULL");
        return -1;
    }
    return 0;
}

/* receive the next part into ``part`` (initialised here); -1 with errno set as libzmq's */
static int recv_part(zmsg *part, void *sock) {
    z_msg_init(part);
    for (;;) {
        int rc;
        ZCALL(release_due(), rc = z_msg_recv(part, sock, Z_DONTWAIT));
        if (rc >= 0)
            return 0;
        if (z_errno() != EINTR) {
            int err = z_errno();
            z_msg_close(part);
            errno = err;
            return -1;
        }
    }
}

static PyObject *zs_collect(PyObject *self, PyObject *unused) {
    collect();
    return PyLong_FromLongLong(PINNED);
}

/* ---- the calls ------------------------------------------------------------------------------ */

/* the arguments every call with a count starts with, (handle, count, ...): checked, and the lent
   buffers libzmq is done with let go first */
static int call_args(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, const char *usage, void **sock,
                     Py_ssize_t *count) {
    if (nargs != want) {
        PyErr_SetString(PyExc_TypeError, usage);
        return -1;
    }
    if (not_loaded() || handle_of(args[0], sock))
        return -1;
    *count = PyLong_AsSsize_t(args[1]);
    if (*count == -1 && PyErr_Occurred())
        return -1;
    collect();
    return 0;
}

static PyObject *zs_events(PyObject *self, PyObject *arg) {
    void *sock;
    if (not_loaded() || handle_of(arg, &sock))
        return NULL;
    collect();
    int events = 0, rc;
    size_t size = sizeof events;
    ZCALL(release_due(), rc = z_getsockopt(sock, Z_EVENTS, &events, &size));
    if (rc < 0)
        return PyLong_FromLong(-(long)z_errno());
    return PyLong_FromLong(events);
}

static PyObject *zs_recv(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    void *sock;
    Py_ssize_t copied, max_parts = PY_SSIZE_T_MAX;
    const char *usage = "recv(handle, copied, release[, max_parts])";
    if (call_args(args, nargs == 4 ? 3 : nargs, 3, usage, &sock, &copied) < 0)
        return NULL;
    if (nargs == 4) {
        max_parts = PyLong_AsSsize_t(args[3]);
        if (max_parts == -1 && PyErr_Occurred())
            return NULL;
        if (max_parts < 1) {
            PyErr_SetString(PyExc_ValueError, "recv: max_parts must be at least 1");
            return NULL;
        }
    }
    int release = PyObject_IsTrue(args[2]);
    if (release < 0)
        return NULL;
    zmsg part;
    if (recv_part(&part, sock) < 0) {
        if (errno == EAGAIN)
            Py_RETURN_NONE;
        return raise_zmq(errno);
    }
    PyObject *frames = PyList_New(0);
    for (Py_ssize_t i = 0;; i++) {
        int more = z_msg_more(&part), moved = 0, shared = release && z_msg_get(&part, Z_SHARED) == 1;
        if (frames != NULL && i < max_parts) {  /* past max_parts: read and dropped, no object each */
            PyObject *item;
            if (i < copied) {
                item = PyBytes_FromStringAndSize(z_msg_data(&part), (Py_ssize_t)z_msg_size(&part));
            } else {
                Msg *m = PyObject_New(Msg, &MsgType);
                if (m != NULL) {
                    z_msg_init(&m->msg);
                    z_msg_move(&m->msg, &part);
                    m->release = shared;
                    moved = 1;
                }
                item = (PyObject *)m;
            }
            if (item == NULL || PyList_Append(frames, item) < 0)
                Py_CLEAR(frames); /* keep reading: the rest of the message must leave the socket */
            Py_XDECREF(item);
        }
        if (moved)
            z_msg_close(&part); /* empty after the move: closing it runs nothing */
        else
            ZCALL(shared, z_msg_close(&part));
        if (!more)
            return frames;
        if (recv_part(&part, sock) < 0) { /* the parts of a message arrive together: never expected */
            int err = errno;
            Py_XDECREF(frames);
            return raise_zmq(err);
        }
    }
}

static int send_msg(Msg *m, void *sock, int flags) {
    zmsg out;
    z_msg_init(&out);
    if (z_msg_copy(&out, &m->msg) < 0) {
        errno = z_errno();
        return -1;
    }
    return send_out(&out, sock, flags);
}

static int send_copy(const void *buf, Py_ssize_t len, void *sock, int flags) {
    int rc;
    do {
        rc = z_send(sock, buf, (size_t)len, flags);
    } while (rc < 0 && z_errno() == EINTR);
    if (rc < 0)
        errno = z_errno();
    return rc;
}

static PyObject *zs_send(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    void *sock;
    Py_ssize_t threshold;
    if (call_args(args, nargs, 3, "send(handle, threshold, frames)", &sock, &threshold) < 0)
        return NULL;
    PyObject *seq = args[2];
    if (!PyList_Check(seq) && !PyTuple_Check(seq))
        return PyLong_FromLong(0);
    /* a tuple of them: what a buffer export or an array's ``base`` might run cannot change it */
    PyObject *frames = PyTuple_Check(seq) ? Py_NewRef(seq) : PyList_AsTuple(seq);
    if (frames == NULL)
        return NULL;
    Py_ssize_t count = PyTuple_GET_SIZE(frames), i;
    int rc = 0;
    for (i = 0; i < count; i++) {
        int flags = Z_DONTWAIT | (i + 1 < count ? Z_SNDMORE : 0);
        PyObject *f = PyTuple_GET_ITEM(frames, i);
        if (PyBytes_CheckExact(f)) {
            rc = send_copy(PyBytes_AS_STRING(f), PyBytes_GET_SIZE(f), sock, flags);
        } else if (Py_TYPE(f) == &MsgType) {
            rc = send_msg((Msg *)f, sock, flags);
        } else {
            Py_buffer view;
            if (PyObject_GetBuffer(f, &view, PyBUF_SIMPLE) < 0) {
                PyErr_Clear();
                break; /* not a plain buffer: pyzmq's to send or refuse, from here on */
            }
            if (view.len < threshold) {
                rc = send_copy(view.buf, view.len, sock, flags);
                PyBuffer_Release(&view);
            } else {
                Msg *m = owning_msg(f, view.buf, view.len);
                if (m != NULL) { /* a received message's bytes: share it */
                    rc = send_msg(m, sock, flags);
                    Py_DECREF(m);
                    PyBuffer_Release(&view);
                } else {
                    rc = send_pinned(&view, sock, flags); /* takes the view over */
                }
            }
        }
        if (rc < 0)
            break;
    }
    int err = errno; /* before the tuple goes: its deallocation may touch errno */
    Py_DECREF(frames);
    if (rc < 0) {
        if (err == EAGAIN && i == 0)
            return PyLong_FromLong(-1);
        return raise_zmq(err);
    }
    return PyLong_FromSsize_t(i);
}

static PyObject *zs_load(PyObject *self, PyObject *args) {
    const char *path;
    PyObject *zmq_error, *ndarray;
    if (!PyArg_ParseTuple(args, "sOO!", &path, &zmq_error, &PyType_Type, &ndarray))
        return NULL;
    void *lib = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    if (lib == NULL)
        return PyErr_Format(PyExc_ImportError, "pyzmq's backend %s is not loaded", path);
    struct {
        void **slot;
        const char *name;
    } syms[] = {
        {(void **)&z_getsockopt, "zmq_getsockopt"}, {(void **)&z_msg_init, "zmq_msg_init"},
        {(void **)&z_msg_recv, "zmq_msg_recv"},     {(void **)&z_msg_send, "zmq_msg_send"},
        {(void **)&z_msg_close, "zmq_msg_close"},   {(void **)&z_msg_copy, "zmq_msg_copy"},
        {(void **)&z_msg_move, "zmq_msg_move"},     {(void **)&z_msg_data, "zmq_msg_data"},
        {(void **)&z_msg_size, "zmq_msg_size"},     {(void **)&z_msg_more, "zmq_msg_more"},
        {(void **)&z_msg_get, "zmq_msg_get"},       {(void **)&z_msg_init_data, "zmq_msg_init_data"},
        {(void **)&z_send, "zmq_send"},             {(void **)&z_errno, "zmq_errno"},
        {(void **)&z_version, "zmq_version"},
    };
    for (size_t i = 0; i < sizeof syms / sizeof syms[0]; i++) {
        *syms[i].slot = dlsym(lib, syms[i].name);
        if (*syms[i].slot == NULL) {
            LOADED = 0;
            return PyErr_Format(PyExc_ImportError, "%s does not export %s", path, syms[i].name);
        }
    }
    int major, minor, patch;
    z_version(&major, &minor, &patch);
    if (major < 4 || (major == 4 && minor < 1)) {
        LOADED = 0;
        return PyErr_Format(PyExc_ImportError, "libzmq %d.%d.%d predates 4.1's message layout", major, minor, patch);
    }
    Py_INCREF(zmq_error);
    Py_XSETREF(ZMQ_ERROR, zmq_error);
    Py_INCREF(ndarray);
    Py_XSETREF(NDARRAY, ndarray);
    LOADED = 1;
    return Py_BuildValue("(iii)", major, minor, patch);
}

static PyMethodDef methods[] = {
    {"load", zs_load, METH_VARARGS, "Resolve libzmq through pyzmq's backend module; its version."},
    {"events", zs_events, METH_O, "ZMQ_EVENTS of the socket, or -errno."},
    {"collect", zs_collect, METH_NOARGS, "Let go of the buffers libzmq is done with; how many are still lent."},
    {"recv", (PyCFunction)(void (*)(void))zs_recv, METH_FASTCALL,
     "One whole message (its first max_parts parts; the rest read and dropped), or None when none waits."},
    {"send", (PyCFunction)(void (*)(void))zs_send, METH_FASTCALL, "Send frames; how many went (-1: refused, EAGAIN)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "zsock_c", NULL, -1, methods};

PyMODINIT_FUNC PyInit_zsock_c(void) {
    S_BASE = PyUnicode_InternFromString("base");
    if (S_BASE == NULL || PyType_Ready(&MsgType) < 0)
        return NULL;
    PyObject *mod = PyModule_Create(&module);
    if (mod == NULL)
        return NULL;
    Py_INCREF(&MsgType);
    if (PyModule_AddObject(mod, "Msg", (PyObject *)&MsgType) < 0) {
        Py_DECREF(&MsgType);
        Py_DECREF(mod);
        return NULL;
    }
    return mod;
}
