"""Coverage-guided fuzzing of the wire decoder (``zmqflow.wire.codec.decode``) with atheris.

One input is split into frames (the first is the header; see ``split_frames``). ``decode`` must
either return a Message or raise ``DecodeError`` (or a subclass); anything else, a hang, or a
decoded message that breaks the codec's invariants (arrays the size their table says, every
frame referenced, a request that does not re-encode) is a finding. Where the compiled codec is
built (``wire/codec_c.c``), so is any input it reads that the Python codec refuses or reads
differently.

    python protocol/fuzz/fuzz_decode.py -atheris_runs=100000 [-max_len=4096] [-timeout=5] [corpus_dir ...]

Crashes are written by libFuzzer to ``crash-<sha1>`` in the current directory (or to
``-artifact_prefix=DIR/``); replay one with ``python protocol/fuzz/fuzz_decode.py crash-<sha1>``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import atheris  # noqa: E402

with atheris.instrument_imports(include=["zmqflow", "msgpack"]):
    import numpy as np

    from zmqflow.wire import codec
    from zmqflow.wire.codec import DecodeError, Limits, Message, decode, encode

# Small limits so the fuzzer reaches the limit checks with short inputs; the defaults are
# exercised too, on every other input.
SMALL = Limits(max_header_bytes=2048, max_frame_bytes=512, max_frames=8, max_container_len=64, max_depth=16,
               max_message_bytes=1024)
SEP = b"\xff\xfe\xfd"  # frame separator inside one fuzz input


def split_frames(data: bytes) -> list[bytes]:
    """The frames one fuzz input stands for: ``header SEP frame SEP frame ...``."""
    return data.split(SEP)


def join_frames(frames: list[bytes]) -> bytes:
    return SEP.join(frames)


def check(frames: list[bytes], limits: Limits) -> None:
    try:
        msg = decode(frames, limits)
    except DecodeError as exc:
        if exc.request_id is not None:
            assert isinstance(exc.request_id, int) and 0 <= exc.request_id < 1 << 64, exc.request_id
        return
    assert isinstance(msg, Message) and msg.kind in (codec.REQUEST, codec.REPLY, codec.ERROR)
    assert len(frames[0]) <= limits.max_header_bytes and len(frames) <= limits.max_frames
    arrays: list[np.ndarray] = []
    _collect(msg.body, arrays)
    assert len(arrays) >= len(frames) - 1, "a tensor frame is not referenced"
    for a in arrays:
        assert a.nbytes <= limits.max_frame_bytes
    # what was accepted can be sent back: a server answers with these bodies (echo)
    if msg.kind != codec.ERROR:
        again = decode(encode(msg), limits if len(arrays) == len(frames) - 1 else codec.DEFAULT_LIMITS)
        assert again.kind == msg.kind and again.id == msg.id


def _collect(obj: object, out: list[np.ndarray]) -> None:
    if isinstance(obj, np.ndarray):
        out.append(obj)
    elif isinstance(obj, list):
        for v in obj:
            _collect(v, out)
    elif isinstance(obj, dict):
        for v in obj.values():
            _collect(v, out)


def same_as_python(frames: list[bytes], limits: Limits) -> None:
    """What the compiled codec reads, the Python codec reads alike (compared as re-encoded frames,
    so NaNs and arrays compare by their bytes)."""
    fast = codec._built.decode(list(frames), limits)
    if fast is None:  # handed back: decode() ran the Python codec on it above
        return
    codec.use_compiled(False)
    try:
        slow = decode(frames, limits)
        assert (fast.kind, fast.id, fast.service, fast.op, fast.deadline, fast.source) == (
            slow.kind, slow.id, slow.service, slow.op, slow.deadline, slow.source)
        assert [bytes(memoryview(f)) for f in encode(fast)] == [bytes(memoryview(f)) for f in encode(slow)]
    finally:
        codec.use_compiled(True)


def test_one_input(data: bytes) -> None:
    frames = split_frames(data)
    for limits in (SMALL, codec.DEFAULT_LIMITS):
        check(frames, limits)
        if codec._built is not None:
            same_as_python(frames, limits)


def seed_corpus(directory: Path) -> None:
    """Every golden vector of ``protocol/vectors`` as a starting input."""
    directory.mkdir(parents=True, exist_ok=True)
    for path in sorted((ROOT / "protocol" / "vectors").rglob("*.json")):
        frames = [bytes.fromhex(h) for h in json.loads(path.read_text())["frames_hex"]]
        (directory / path.stem).write_bytes(join_frames(frames))


def main() -> None:
    args = sys.argv
    corpus = [a for a in args[1:] if not a.startswith("-")]
    if not corpus:  # start from the golden vectors
        seeds = Path(os.environ.get("ZMQFLOW_FUZZ_CORPUS", ROOT / "protocol" / "fuzz" / "corpus" / "decode"))
        seed_corpus(seeds)
        args = [*args, str(seeds)]
    atheris.Setup(args, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
