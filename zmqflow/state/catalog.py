"""The catalog of variable names, sans-IO: one record per variable, saying where its parts live.

Every declaration goes through the catalog, which serializes them: two sessions declaring one
name concurrently get the same record, and the placement counter (round-robin) or byte counts
(greedy) see every variable of the cluster, as a single ``replica_device_setter`` would.
"""

from __future__ import annotations

from typing import Any

from ..errors import InvalidArgument, NotFound, VariableConflict

__all__ = ["Catalog"]


class Catalog:
    def __init__(self, shards: list[str]):
        if not shards:
            raise InvalidArgument("a catalog needs at least one shard")
        self.shards = list(shards)
        self.records: dict[str, dict[str, Any]] = {}
        self._next = 0
        self.bytes = {s: 0 for s in self.shards}

    def declare(
        self,
        name: str,
        shape: list[int],
        dtype: str,
        part_rows: list[list[int]],
        part_bytes: list[int],
        *,
        device: str | None = None,
        policy: str = "round_robin",
        optimizer: Any = None,
        initializer: Any = None,
        table: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The variable's record, created (with placement) on first declaration. ``table``
        describes an embedding table (kind, strategy, sizes); it must match on redeclaration."""
        if not isinstance(name, str) or not name:
            raise InvalidArgument(f"variable name must be a non-empty string, got {name!r}")
        if len(part_rows) != len(part_bytes) or not part_rows:
            raise InvalidArgument(f"variable {name!r}: {len(part_rows)} part row ranges but {len(part_bytes)} part sizes")
        found = self.records.get(name)
        if found is not None:
            mine = (found["shape"], found["dtype"], [p["rows"] for p in found["parts"]])
            theirs = (list(shape), dtype, [list(r) for r in part_rows])
            if found.get("table") != table:
                raise VariableConflict(f"{name!r} exists as {_kind(found.get('table'))}; declared as {_kind(table)}")
            if mine != theirs:
                raise VariableConflict(
                    f"variable {name!r} exists with shape {mine[0]} {mine[1]} in {len(mine[2])} part(s) {mine[2]}; "
                    f"declared with shape {theirs[0]} {theirs[1]} in {len(theirs[2])} part(s) {theirs[2]}"
                )
            return found
        tasks = [self._place(device, policy, b) for b in part_bytes]
        record = {
            "name": name,
            "shape": list(shape),
            "dtype": dtype,
            "parts": [{"task": t, "rows": list(r)} for t, r in zip(tasks, part_rows)],
            "optimizer": optimizer,
            "initializer": initializer,
            "table": table,
            "ready": False,
        }
        self.records[name] = record
        return record

    def _place(self, device: str | None, policy: str, nbytes: int) -> str:
        if device is not None:
            task = device
        elif policy == "greedy":
            task = min(self.shards, key=lambda s: (self.bytes[s], self.shards.index(s)))
        elif policy == "round_robin":
            task = self.shards[self._next % len(self.shards)]
            self._next += 1
        else:
            raise InvalidArgument(f"unknown placement policy {policy!r} (round_robin, greedy)")
        self.bytes[task] = self.bytes.get(task, 0) + int(nbytes)
        return task

    def mark_ready(self, name: str) -> dict[str, Any]:
        record = self.lookup(name)
        record["ready"] = True
        return record

    def lookup(self, name: str) -> dict[str, Any]:
        found = self.records.get(name)
        if found is None:
            raise NotFound(f"no variable named {name!r}")
        return found

    def ready(self, name: str) -> bool:
        found = self.records.get(name)
        return bool(found and found["ready"])

    def uninitialized(self, names: list[str]) -> list[str]:
        return [n for n in names if not self.ready(n)]


def _kind(table: dict[str, Any] | None) -> str:
    if table is None:
        return "a variable"
    return "an embedding table " + ", ".join(f"{k}={v}" for k, v in sorted(table.items()))
