"""A task's name, ``job:index``: what every push, pull and call keys its shards by."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError

__all__ = ["TaskId"]

_TASK_RES = (
    re.compile(r"^(?P<job>[A-Za-z][A-Za-z0-9_\-]*):(?P<index>\d+)$", re.ASCII),
    re.compile(r"^/job:(?P<job>[A-Za-z][A-Za-z0-9_\-]*)(/replica:\d+)?/task:(?P<index>\d+)(/.*)?$", re.ASCII),
)
_PARSED: "dict[str, TaskId]" = {}  # TaskId.parse's answers by string; cleared when full
_PARSED_MAX = 4096


@dataclass(frozen=True, slots=True, order=True)
class TaskId:
    """A task: a job name and an index. ``str()`` is ``job:index``; ``device`` is TF's form.

    Its hash is computed once: a pull or push of a model of many variables looks its parts'
    tasks up several times a part (the generated ``__hash__`` hashed a new tuple each time)."""

    job: str
    index: int
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.job, self.index)))

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple[Any, ...]:
        """Rebuilt from its fields: a string's hash differs from one process to another."""
        return (type(self), (self.job, self.index))

    @classmethod
    def parse(cls, value: "str | TaskId") -> "TaskId":
        """The task ``value`` names; one instance per string (``_PARSED``), so that the dicts a
        push or pull keys by its parts' tasks match them by identity, not by ``__eq__``."""
        if isinstance(value, TaskId):
            return value
        if isinstance(value, str):
            if (known := _PARSED.get(value)) is not None and cls is TaskId:
                return known
            for pattern in _TASK_RES:
                if m := pattern.match(value.strip()):
                    task = cls(m["job"], int(m["index"]))
                    if cls is TaskId:
                        if len(_PARSED) >= _PARSED_MAX:
                            _PARSED.clear()
                        _PARSED[value] = task
                    return task
        raise ConfigError(f"malformed task {value!r}: expected 'job:index' or '/job:name/task:index'")

    @property
    def device(self) -> str:
        return f"/job:{self.job}/task:{self.index}"

    def __str__(self) -> str:
        return f"{self.job}:{self.index}"
