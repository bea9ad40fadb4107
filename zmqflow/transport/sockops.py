"""The channel's socket calls in C (``zsock_c``), when they can be used here.

``zsock_c`` calls libzmq on pyzmq's socket handles (``Socket.underlying``), resolving libzmq
through pyzmq's own backend module so that both act on the same library: a whole message
received in one call, ``EVENTS`` read without pyzmq's option enums, a message sent in one call,
and large buffers lent to libzmq zero-copy and let go at the process's next socket call (pyzmq
wakes a collector thread, which takes the GIL, once per such message). It is optional: where it
was not built, pyzmq's backend is not a loaded module file, its libzmq exports no symbols (a
static build) or predates 4.1, the channel uses pyzmq's calls. ``ops()`` is the module to use,
or None; ``use_compiled(False)`` turns it off for channels made afterwards.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

import numpy as np
import zmq

__all__ = ["ops", "compiled", "use_compiled", "why_not", "MSG"]


def _load() -> tuple[ModuleType | None, str]:
    try:
        mod = importlib.import_module(".zsock_c", __package__)
    except ImportError as exc:
        return None, f"not built ({exc})"
    backend = sys.modules.get(zmq.backend.Socket.__module__)
    path = getattr(backend, "__file__", None)
    if not path or not path.endswith((".so", ".pyd", ".dylib")):
        return None, f"pyzmq's backend ({zmq.backend.Socket.__module__}) is not a compiled module file"
    try:
        version = mod.load(path, zmq.ZMQError, np.ndarray)
    except ImportError as exc:
        return None, str(exc)
    if tuple(version) != tuple(zmq.zmq_version_info()):
        return None, f"libzmq {version} found, pyzmq reports {zmq.zmq_version_info()}"
    return mod, ""


_MODULE, _WHY = _load()
_on = _MODULE is not None
# the type of the data frames a channel receives through the C calls (pyzmq's receive gives zmq.Frame)
MSG: type | None = _MODULE.Msg if _MODULE is not None else None


def compiled() -> bool:
    """Whether the C socket calls were built and bound to pyzmq's libzmq here."""
    return _MODULE is not None


def why_not() -> str:
    """Why the C socket calls are not available ('' when they are)."""
    return _WHY


def use_compiled(on: bool) -> bool:
    """Turn the C socket calls on or off for channels made from now on; the previous setting."""
    global _on
    before = _on
    _on = bool(on) and _MODULE is not None
    return before


def ops() -> ModuleType | None:
    """The ``zsock_c`` module for a new channel, or None (pyzmq's calls)."""
    return _MODULE if _on else None
