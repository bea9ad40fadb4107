"""Keep an input a harness found as a regression vector in ``protocol/vectors/fuzz/``.

    python protocol/fuzz/keep.py decode|router CRASH_FILE NAME "what it broke and how it is answered now"

The vector has the golden vectors' format (``name``, ``description``, ``frames_hex``,
``decoded``, ``expect``). A message the decoder refuses is kept with ``decoded: null`` and
``expect: {error, request_id}``; a request that decodes is kept with its decoded form and
``expect: {code}``, the error code its op's validator must now answer with.
``tests/test_fuzz.py`` replays every vector kept here.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
OUT = ROOT / "protocol" / "vectors" / "fuzz"


def _module(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def frames_of(harness: str, data: bytes) -> list[bytes]:
    fuzz = _module(f"fuzz_{harness}", ROOT / "protocol" / "fuzz" / f"fuzz_{harness}.py")
    if harness == "decode":
        return fuzz.split_frames(data)
    return fuzz.frames_of(data)


def vector(name: str, description: str, frames: list[bytes]) -> dict:
    from zmqflow.errors import VersionMismatch, ZmqflowError
    from zmqflow.wire import DecodeError, decode
    from zmqflow.wire.requests import SERVICES, compile_validator

    mv = _module("make_vectors", ROOT / "protocol" / "make_vectors.py")
    try:
        msg = decode(frames)
    except DecodeError as exc:
        error = "VersionMismatch" if isinstance(exc, VersionMismatch) else "DecodeError"
        return mv._invalid(name, description, frames, error, exc.request_id)
    out = {"name": name, "description": description, "frames_hex": mv.frames_hex(frames),
           "decoded": mv.message_to_json(msg), "expect": {}}
    try:
        compile_validator(msg.service, msg.op, SERVICES[msg.service][msg.op])(msg.body)
    except ZmqflowError as exc:
        out["expect"]["code"] = exc.code
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 5 or argv[1] not in ("decode", "router"):
        print(__doc__)
        return 2
    _, harness, crash, name, description = argv
    v = vector(name, description, frames_of(harness, Path(crash).read_bytes()))
    mv = _module("make_vectors", ROOT / "protocol" / "make_vectors.py")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{name}.json").write_text(mv.dumps(v) + "\n")
    print(OUT / f"{name}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
