/* Received parts (Msg: a writable buffer over libzmq's own message, no copy) and buffers lent to
   libzmq for a zero-copy send (pins), for zsock_c.c's calls. */

#include <pthread.h>

#include "zsock_c.h"

/* ---- Msg: one received part, its bytes exported without a copy ---------------------------- */

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

PyTypeObject MsgType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "zmqflow.transport.zsock_c.Msg",
    .tp_basicsize = sizeof(Msg),
    .tp_dealloc = (destructor)msg_dealloc,
    .tp_as_sequence = &msg_as_sequence,
    .tp_as_buffer = &msg_as_buffer,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A received message part: a writable buffer over libzmq's own memory (no copy).",
    .tp_getset = msg_getset,
};

/* the Msg whose memory is exactly [buf, buf + len), reached from ``obj`` through array bases and
   memoryviews (new reference), else NULL without an error set */
Msg *owning_msg(PyObject *obj, void *buf, Py_ssize_t len) {
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

/* send ``out`` (libzmq owns it once sent; closed here when the send fails), errno set on failure */
int send_out(zmsg *out, void *sock, int flags) {
    int rc;
    do {
        rc = z_msg_send(out, sock, flags);
    } while (rc < 0 && z_errno() == EINTR);
    if (rc < 0) {
        int err = z_errno();
        z_msg_close(out);
        errno = err;
    }
    return rc;
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
long long PINNED; /* lent and not let go yet (with the GIL) */

static void pin_free(void *data, void *hint) {
    Pin *pin = (Pin *)hint;
    pthread_mutex_lock(&PIN_LOCK);
    pin->next = FREED;
    __atomic_store_n(&FREED, pin, __ATOMIC_RELEASE); /* collect() peeks without the lock */
    pthread_mutex_unlock(&PIN_LOCK);
}

/* let go of the buffers libzmq is done with; the GIL is held */
void collect(void) {
    if (__atomic_load_n(&FREED, __ATOMIC_ACQUIRE) == NULL)
        return;
    pthread_mutex_lock(&PIN_LOCK);
    Pin *pin = FREED;
    __atomic_store_n(&FREED, NULL, __ATOMIC_RELAXED);
    pthread_mutex_unlock(&PIN_LOCK);
    while (pin != NULL) {
        Pin *next = pin->next;
        PyBuffer_Release(&pin->view);
        PyMem_RawFree(pin);
        PINNED--;
        pin = next;
    }
}

/* send ``view`` zero-copy, taking it over: let go at the first collect after libzmq is done with
   it, or after the send failed */
int send_pinned(Py_buffer *view, void *sock, int flags) {
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
    return send_out(&out, sock, flags); /* a failure closes it: pin_free, let go at the next collect */
}
