/* What zsock_c.c (the calls, the module) and zsock_buffers.c (received parts and lent buffers)
   share: libzmq's functions as zsock_c.load() resolved them, the message types, and when a call
   lets the GIL go. */

#ifndef ZSOCK_C_H
#define ZSOCK_C_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>

typedef struct {
    _Alignas(8) unsigned char _[64]; /* zmq_msg_t since libzmq 4.1 */
} zmsg;

#define Z_DONTWAIT 1
#define Z_SNDMORE 2
#define Z_EVENTS 15
#define Z_SHARED 3

extern int (*z_getsockopt)(void *, int, void *, size_t *);
extern int (*z_msg_init)(zmsg *);
extern int (*z_msg_init_data)(zmsg *, void *, size_t, void (*)(void *, void *), void *);
extern int (*z_msg_recv)(zmsg *, void *, int);
extern int (*z_msg_send)(zmsg *, void *, int);
extern int (*z_msg_close)(zmsg *);
extern int (*z_msg_copy)(zmsg *, zmsg *);
extern int (*z_msg_move)(zmsg *, zmsg *);
extern void *(*z_msg_data)(zmsg *);
extern size_t (*z_msg_size)(const zmsg *);
extern int (*z_msg_more)(const zmsg *);
extern int (*z_msg_get)(const zmsg *, int);
extern int (*z_send)(void *, const void *, size_t, int);
extern int (*z_errno)(void);
extern void (*z_version)(int *, int *, int *);

extern PyObject *NDARRAY, *S_BASE; /* np.ndarray, "base" */
extern PyTypeObject MsgType;
extern long long PINNED; /* buffers lent to libzmq and not let go yet */

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
int release_due(void);

#define ZCALL(release, stmt)                                                                                           \
    do {                                                                                                               \
        if (release) {                                                                                                 \
            Py_BEGIN_ALLOW_THREADS stmt;                                                                               \
            Py_END_ALLOW_THREADS                                                                                       \
        } else {                                                                                                       \
            stmt;                                                                                                      \
        }                                                                                                              \
    } while (0)

Msg *owning_msg(PyObject *obj, void *buf, Py_ssize_t len);
int send_out(zmsg *out, void *sock, int flags);
int send_pinned(Py_buffer *view, void *sock, int flags);
void collect(void);

#endif
