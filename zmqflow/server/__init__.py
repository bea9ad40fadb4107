"""The server side: one task server per task and the services it hosts."""

from .task import AsyncServer, Server

__all__ = ["AsyncServer", "Server"]
