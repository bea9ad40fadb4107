/* A channel's socket calls in C: libzmq called straight, on the handle pyzmq exposes
   (Socket.underlying), skipping pyzmq's per-call Python work (option enums, a Frame object and an
   exception per empty receive). The libzmq is the one pyzmq's own backend module is linked to,
   found through that module's handle, so both act on the same sockets.

   load(backend_path, zmq_error, ndarray) -> (major, minor, patch)
       once, from zmqflow/transport/sockops.py: resolves libzmq through pyzmq's backend module.
   events(handle)                  -> ZMQ_EVENTS, or -errno
   recv(handle, copied, release)   -> [frames] | None (nothing waiting): the first ``copied`` parts
                                      as bytes, the rest as zero-copy Msg objects
   send(handle, threshold, frames) -> frames sent: all of them, or -1 (the first was refused with
                                      EAGAIN: nothing sent), or k: frame k is no contiguous buffer,
                                      and the caller sends it and the rest with pyzmq. Frames under
                                      ``threshold`` bytes are copied; a received Msg (or an array
                                      over exactly its bytes) goes out sharing libzmq's message;
                                      any other buffer goes out zero-copy, lent (see pins).
   collect()                       -> let go of lent buffers libzmq is done with (every call
                                      above does it first); how many are still lent

   ``release``: the socket's peers may be in this process (inproc), so a shared part is closed with
   the GIL let go (see below). Any other failure raises zmq.ZMQError(errno). The caller keeps the
   socket open while it calls here; nothing here holds the handle. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <time.h>

typedef struct {
    _Alignas(8) unsigned char _[64]; /* zmq_msg_t since libzmq 4.1 */
} zmsg;

#define Z_DONTWAIT 1
#define Z_SNDMORE 2
#define Z_EVENTS 15
#define Z_SHARED 3

static int (*z_getsockopt)(void *, int, void *, size_t *);
static int (*z_msg_init)(zmsg *);
static int (*z_msg_init_data)(zmsg *, void *, size_t, void (*)(void *, void *), void *);
static int (*z_msg_recv)(zmsg *, void *, int);
static int (*z_msg_send)(zmsg *, void *, int);
static int (*z_msg_close)(zmsg *);
static int (*z_msg_copy)(zmsg *, zmsg *);
static int (*z_msg_move)(zmsg *, zmsg *);
static void *(*z_msg_data)(zmsg *);
static size_t (*z_msg_size)(const zmsg *);
static int (*z_msg_more)(const zmsg *);
static int (*z_msg_get)(const zmsg *, int);
static int (*z_send)(void *, const void *, size_t, int);
static int (*z_errno)(void);
static void (*z_version)(int *, int *, int *);

static PyObject *ZMQ_ERROR, *NDARRAY, *S_BASE;
static int LOADED;

/* ---- Msg: one received part, its bytes exported without a copy ---------------------------- */

typedef struct {
    PyObject_HEAD zmsg msg;
    int release; /* its close lets the GIL go: it may hold a buffer pyzmq sent zero-copy */
} Msg;

/* Closing a received message may run its sender's free function: over inproc, one that pyzmq sent
   zero-copy, whose free function hands the buffer to pyzmq's collector thread and waits for room on
   its socket, which that thread only makes once it holds the GIL. So on a socket whose peers may
   be in this process (inproc) a received part whose content is shared (ZMQ_SHARED: what pyzmq
   sends zero-copy always is, as it sends a copy of its Frame's message) is closed with the GIL let
   go, as pyzmq's Frame does; a part that libzmq copied has no free function to run, and elsewhere
   each message is the decoder's own memory. (A call can also close messages: the unread ones of a
   pipe that ends, at most its high-water mark, which pyzmq's collector queue holds.)

   The calls themselves keep the GIL, but for a receive or an EVENTS look when the last release
   here was RELEASE_EVERY_NS ago. pyzmq lets it go in every call; where another thread wants it (a
   server on a loop thread of this process) each release is a hand-over, and together they cost
   ~10 us a round trip over inproc. Never letting it go starves the process's other threads while
   its loops are busy: a build running off the loop took 30 s instead of 1.5 s under a stream of
   pings. One release per 200 us keeps both. */
#define RELEASE_EVERY_NS 200000LL
static long long LAST_RELEASE;

static int release_due(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    long long now = (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
    if (now - LAST_RELEASE < RELEASE_EVERY_NS)
        return 0;
    LAST_RELEASE = now; /* read and written with the GIL held */
    return 1;
}

#define ZCALL(release, stmt)                                                                                           \
    do {                                                                                                               \
        if (release) {                                                                                                 \
            Py_BEGIN_ALLOW_THREADS stmt;                                                                               \
            Py_END_ALLOW_THREADS                                                                                       \
        } else {                                                                                                       \
            stmt;                                                                                                      \
        }                                                                                                              \
    } while (0)

static void msg_dealloc(Msg *self) {
    ZCALL(self->release, z_msg_close(&self->msg));
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int msg_getbuffer(Msg *self, Py_buffer *view, int flags) {
    return PyBuffer_FillInfo(view, (PyObject *)self, z_msg_data(&self->msg), (Py_ssize_t)z_msg_size(&self->msg), 0, flags);
}

static Py_ssize_t msg_len(Msg *self) { return (Py_ssize_t)z_msg_size(&self->msg); }

static PyObject *msg_bytes(Msg *self, void *closure) {
    return PyBytes_FromStringAndSize(z_msg_data(&self->msg), (Py_ssize_t)z_msg_size(&self->msg));
}

static PyBufferProcs msg_as_buffer = {(getbufferproc)msg_getbuffer, NULL};
static PySequenceMethods msg_as_sequence = {.sq_length = (lenfunc)msg_len};
static PyGetSetDef msg_getset[] = {
    {"bytes", (getter)msg_bytes, NULL, "A copy of the part's bytes.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject MsgType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "zmqflow.transport.zsock_c.Msg",
    .tp_basicsize = sizeof(Msg),
    .tp_dealloc = (destructor)msg_dealloc,
    .tp_as_sequence = &msg_as_sequence,
    .tp_as_buffer = &msg_as_buffer,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A received message part: a writable buffer over libzmq's own memory (no copy).",
    .tp_getset = msg_getset,
};

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

/* the Msg whose memory is exactly [buf, buf + len), reached from ``obj`` through array bases and
   memoryviews (new reference), else NULL without an error set */
static Msg *owning_msg(PyObject *obj, void *buf, Py_ssize_t len) {
    PyObject *o = obj;
    Py_INCREF(o);
    for (int depth = 0; depth < 8; depth++) {
        PyObject *next = NULL;
        if (Py_TYPE(o) == &MsgType) {
            Msg *m = (Msg *)o;
            if (z_msg_data(&m->msg) == buf && (Py_ssize_t)z_msg_size(&m->msg) == len)
                return m;
            break;
        }
        if (PyMemoryView_Check(o)) {
            next = PyMemoryView_GET_BUFFER(o)->obj;
            Py_XINCREF(next);
        } else if (PyObject_TypeCheck(o, (PyTypeObject *)NDARRAY)) {
            next = PyObject_GetAttr(o, S_BASE);
            if (next == NULL)
                PyErr_Clear();
        }
        Py_DECREF(o);
        if (next == NULL || next == Py_None) {
            Py_XDECREF(next);
            return NULL;
        }
        o = next;
    }
    Py_DECREF(o);
    return NULL;
}

/* ---- pins: buffers lent to libzmq ------------------------------------------------------------ */

/* A large buffer goes out zero-copy: libzmq reads it until the message is sent (tcp, ipc) or
   dropped by its receiver (inproc), and then calls pin_free, from whichever thread that is. The
   buffer's owner must live until then, and letting it go needs the GIL, which that thread may not
   take (an I/O thread waiting on Python would stall the process's network). pyzmq hands each
   freed buffer to a collector thread of its own, which wakes and takes the GIL once per message.
   Here pin_free only queues the pin, under a plain mutex; the next socket call of the process
   (every call here begins so) lets the queued buffers go, with the GIL it already holds. So a
   buffer is held until this process's next send, receive or EVENTS look: a reply or the next
   request, in a process that moves tensors. */
typedef struct Pin {
    struct Pin *next;
    Py_buffer view; /* holds a reference to the buffer's owner */
} Pin;

static pthread_mutex_t PIN_LOCK = PTHREAD_MUTEX_INITIALIZER;
static Pin *FREED;       /* freed by libzmq, not yet let go: under PIN_LOCK */
static long long PINNED; /* lent and not let go yet (with the GIL) */

static void pin_free(void *data, void *hint) {
    Pin *pin = (Pin *)hint;
    pthread_mutex_lock(&PIN_LOCK);
    pin->next = FREED;
    FREED = pin;
    pthread_mutex_unlock(&PIN_LOCK);
}

/* let go of the buffers libzmq is done with; the GIL is held */
static void collect(void) {
    if (__atomic_load_n(&FREED, __ATOMIC_ACQUIRE) == NULL)
        return;
    pthread_mutex_lock(&PIN_LOCK);
    Pin *pin = FREED;
    FREED = NULL;
    pthread_mutex_unlock(&PIN_LOCK);
    while (pin != NULL) {
        Pin *next = pin->next;
        PyBuffer_Release(&pin->view);
        PyMem_RawFree(pin);
        PINNED--;
        pin = next;
    }
}

/* send ``view`` zero-copy, taking it over (released once libzmq is done, or now on failure) */
static int send_pinned(Py_buffer *view, void *sock, int flags) {
    Pin *pin = PyMem_RawMalloc(sizeof *pin);
    if (pin == NULL) {
        PyBuffer_Release(view);
        errno = ENOMEM;
        return -1;
    }
    pin->view = *view;
    PINNED++;
    zmsg out;
    if (z_msg_init_data(&out, view->buf, (size_t)view->len, pin_free, pin) < 0) {
        int err = z_errno();
        pin_free(NULL, pin); /* never lent */
        errno = err;
        return -1;
    }
    int rc;
    do {
        rc = z_msg_send(&out, sock, flags);
    } while (rc < 0 && z_errno() == EINTR);
    if (rc < 0) {
        int err = z_errno();
        z_msg_close(&out); /* runs pin_free: the buffer is let go at the next collect */
        errno = err;
    }
    return rc;
}

static PyObject *zs_collect(PyObject *self, PyObject *unused) {
    collect();
    return PyLong_FromLongLong(PINNED);
}

/* ---- the calls ------------------------------------------------------------------------------ */

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
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "recv(handle, copied, release)");
        return NULL;
    }
    if (not_loaded() || handle_of(args[0], &sock))
        return NULL;
    Py_ssize_t copied = PyLong_AsSsize_t(args[1]);
    if (copied == -1 && PyErr_Occurred())
        return NULL;
    int release = PyObject_IsTrue(args[2]);
    if (release < 0)
        return NULL;
    collect();
    zmsg part;
    if (recv_part(&part, sock) < 0) {
        if (errno == EAGAIN)
            Py_RETURN_NONE;
        return raise_zmq(errno);
    }
    PyObject *frames = PyList_New(0);
    for (Py_ssize_t i = 0;; i++) {
        int more = z_msg_more(&part), moved = 0, shared = release && z_msg_get(&part, Z_SHARED) == 1;
        if (frames != NULL) {
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
    if (z_msg_copy(&out, &m->msg) < 0)
        return -1;
    int rc;
    do {
        rc = z_msg_send(&out, sock, flags);
    } while (rc < 0 && z_errno() == EINTR);
    if (rc < 0) {
        int err = z_errno();
        z_msg_close(&out);
        errno = err;
    }
    return rc;
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
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "send(handle, threshold, frames)");
        return NULL;
    }
    if (not_loaded() || handle_of(args[0], &sock))
        return NULL;
    Py_ssize_t threshold = PyLong_AsSsize_t(args[1]);
    if (threshold == -1 && PyErr_Occurred())
        return NULL;
    collect();
    PyObject *seq = args[2];
    if (!PyList_Check(seq) && !PyTuple_Check(seq))
        return PyLong_FromLong(0);
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < count; i++) {
        int flags = Z_DONTWAIT | (i + 1 < count ? Z_SNDMORE : 0);
        PyObject *f = items[i];
        int rc;
        if (PyBytes_CheckExact(f)) {
            rc = send_copy(PyBytes_AS_STRING(f), PyBytes_GET_SIZE(f), sock, flags);
        } else if (Py_TYPE(f) == &MsgType) {
            rc = send_msg((Msg *)f, sock, flags);
        } else {
            Py_buffer view;
            if (PyObject_GetBuffer(f, &view, PyBUF_SIMPLE) < 0) {
                PyErr_Clear();
                return PyLong_FromSsize_t(i); /* not a plain buffer: pyzmq's to send or refuse */
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
        if (rc < 0) {
            if (errno == EAGAIN && i == 0)
                return PyLong_FromLong(-1);
            return raise_zmq(errno);
        }
    }
    return PyLong_FromSsize_t(count);
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
    {"recv", (PyCFunction)(void (*)(void))zs_recv, METH_FASTCALL, "One whole message, or None when none waits."},
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
