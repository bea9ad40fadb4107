"""Where ``zmqflow launch`` sends its tasks' output: the terminal (one ``[task]`` prefix per line),
optionally one log file per task (``--log-dir``), and a short tail per task kept in memory so a
failure can be summarised with the lines that led to it."""

from __future__ import annotations

import collections
import os
import signal
import threading
import time
from typing import IO

__all__ = ["TaskOutput", "describe_exit", "log_path", "TAIL_LINES"]

TAIL_LINES = 10


def describe_exit(returncode: int) -> str:
    """``code 3``, or ``code 137 (SIGKILL)`` for a process a signal ended (shell-style code)."""
    if returncode >= 0:
        return f"code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    return f"code {128 - returncode} ({name})"


def log_path(log_dir: str, task: object) -> str:
    """``DIR/worker-0.log`` for task ``worker:0`` (no colon: it is awkward in file names)."""
    return os.path.join(log_dir, str(task).replace(":", "-") + ".log")


class TaskOutput:
    """Serialises every line written to the terminal, and keeps per-task files and tails.

    The lock is re-entrant so a line may be written while the launcher holds it for its own
    bookkeeping (they share it)."""

    def __init__(self, out: IO[str], log_dir: str | None = None, tail: int = TAIL_LINES):
        self.out = out
        self.log_dir = log_dir
        self.lock = threading.RLock()
        self._files: dict[str, IO[str]] = {}
        self._tails: dict[str, collections.deque[str]] = {}
        self._tail = tail
        self._out_gone = False  # the terminal took no more output: write none there
        if log_dir is not None:
            os.makedirs(log_dir, exist_ok=True)

    def say(self, line: str, tag: str = "launch") -> None:
        with self.lock:
            self._write(f"[{tag}] {line}\n")

    def _write(self, text: str) -> None:
        """To the terminal, while it takes output: a closed pipe (``| head``) or a full disk ends
        what launch prints, never its reading of the tasks' output or its watch over them."""
        if self._out_gone:
            return
        try:
            self.out.write(text)
            self.out.flush()
        except (OSError, ValueError):
            self._out_gone = True

    def started(self, task: object, pid: int, restarts: int) -> None:
        """A process for ``task`` began: a fresh tail, and a marker line in its log file (appended)."""
        key = str(task)
        with self.lock:
            self._tails[key] = collections.deque(maxlen=self._tail)
            if self.log_dir is None:
                return
            fh = self._files.get(key)
            if fh is None:
                fh = self._files[key] = open(log_path(self.log_dir, key), "a", encoding="utf-8")
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            fh.write(f"=== zmqflow launch: {key} started at {stamp}, pid {pid}, restart {restarts} ===\n")
            fh.flush()

    def line(self, task: object, text: str) -> None:
        """One line of ``task``'s output: to the terminal tagged once, to its file untagged."""
        key = str(task)
        with self.lock:
            self._write(f"[{key}] {text}\n")
            tail = self._tails.get(key)
            if tail is not None:
                tail.append(text)
            fh = self._files.get(key)
            if fh is not None:
                fh.write(text + "\n")
                fh.flush()

    def ended(self, task: object, returncode: int) -> None:
        """The process ended: a closing marker in its log file (the file stays open for a restart)."""
        with self.lock:
            fh = self._files.get(str(task))
            if fh is not None:
                fh.write(f"=== zmqflow launch: {task} exited with {describe_exit(returncode)} ===\n")
                fh.flush()

    def tail(self, task: object) -> list[str]:
        with self.lock:
            return list(self._tails.get(str(task), ()))

    def summary(self, failed: list[tuple[object, int, int]]) -> None:
        """For each (task, returncode, restarts): what ended it, then its last lines."""
        if not failed:
            return
        with self.lock:
            self.say(f"{len(failed)} task{'s' if len(failed) > 1 else ''} failed:")
            for task, returncode, restarts in failed:
                after = f" after {restarts} restart{'s' if restarts != 1 else ''}" if restarts else ""
                lines = self.tail(task)
                where = f"; log {log_path(self.log_dir, task)}" if self.log_dir is not None else ""
                self.say(f"  {task} exited with {describe_exit(returncode)}{after}{where}; "
                         f"last {len(lines)} line{'s' if len(lines) != 1 else ''}:")
                for text in lines:
                    self.say(f"    | {text}")

    def close(self) -> None:
        with self.lock:
            for fh in self._files.values():
                fh.close()
            self._files.clear()
