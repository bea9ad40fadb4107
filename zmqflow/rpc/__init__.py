"""Remote calls between tasks: requests with deadlines, replies or typed errors."""

from .client import DEFAULT_TIMEOUT, RpcClient
from .counters import Counters
from .server import RpcServer
from .service import CallContext, Service, op

__all__ = ["DEFAULT_TIMEOUT", "RpcClient", "RpcServer", "Counters", "CallContext", "Service", "op"]
