"""Bad command-line input: one clear line and a usage exit code, never a traceback or a hang."""

from __future__ import annotations

import json

import pytest

from zmqflow import errors
from zmqflow.cli.serve import MAX_SIZE, limits_from_flags, parse_size
from zmqflow.server.limits import ServerLimits
from zmqflow.testing import free_port

from .conftest import ZMQFLOW


def test_keys_generate_over_a_half_written_directory_names_the_file_and_force(tmp_path, procs):
    """A run cut short leaves key files and no allow-list: a rerun says which file is in the way."""
    left = tmp_path / "k" / "tasks" / "task.key_secret"
    left.parent.mkdir(parents=True)
    left.write_text("")
    p = procs([*ZMQFLOW, "keys", "generate", str(tmp_path / "k")])
    assert p.wait(30) == 2, p.output
    assert p.output.splitlines() == [f"zmqflow keys: cannot write {left}: it already exists (left by an earlier "
                                     f"run?); pass --force to replace the keys in {tmp_path / 'k'}"]
    assert not (tmp_path / "k" / "allow.json").exists()
    forced = procs([*ZMQFLOW, "keys", "generate", str(tmp_path / "k"), "--force"])
    assert forced.wait(30) == 0, forced.output
    assert "secret-key" in left.read_text() and (tmp_path / "k" / "allow.json").exists()


def test_keys_generate_where_a_file_blocks_the_path_is_one_line(tmp_path, procs):
    (tmp_path / "file").write_text("")
    p = procs([*ZMQFLOW, "keys", "generate", str(tmp_path / "file" / "keys")])
    assert p.wait(30) == 2, p.output
    (line,) = p.output.splitlines()
    assert line.startswith(f"zmqflow keys: cannot write keys to {tmp_path / 'file' / 'keys'}: "), line


@pytest.mark.parametrize("flag, value, needle", [
    ("--max-frame-bytes", "99999999999TiB", "more than the largest size libzmq takes (9223372036854775807 bytes)"),
    ("--max-variable-bytes", "1" + "0" * 60, "more than the largest size libzmq takes"),
    ("--max-shard-bytes", "0.5", "'0.5' is under one byte"),
    ("--max-frame-bytes", "lots", "'lots' is not a size"),
    ("--idle-trim", "nan", "'nan' is not a finite number"),
    ("--max-deadline", "inf", "'inf' is not a finite number"),
    ("--max-deadline", "0", "0 is not in the range x>0"),
    ("--max-in-flight", "0", "0 is not in the range x>=1"),
    ("--max-run-threads", "0", "0 is not in the range x>=1"),
])
def test_serve_refuses_numbers_libzmq_or_a_clock_cannot_take(tmp_path, procs, flag, value, needle):
    spec = {"worker": [f"127.0.0.1:{free_port()}"]}
    p = procs([*ZMQFLOW, "serve", "--cluster", json.dumps(spec), "--task", "worker:0", flag, value])
    assert p.wait(30) == 2, p.output
    assert f"Invalid value for '{flag}': " in p.output and needle in p.output, p.output
    assert "Traceback" not in p.output and "serving" not in p.output


def test_sizes_are_exact_and_capped_at_int64():
    assert parse_size("1.5GiB") == 3 << 29 and parse_size(str(MAX_SIZE)) == MAX_SIZE == (1 << 63) - 1
    assert parse_size("8TiB") == 8 << 40
    for text in (str(MAX_SIZE + 1), "8388608TiB", "9" * 400):
        with pytest.raises(errors.ConfigError, match="more than the largest size libzmq takes"):
            parse_size(text)
    with pytest.raises(errors.ConfigError, match="--max-frame-bytes: '1e9' is not a size"):
        limits_from_flags({"max_frame_bytes": "1e9"})
    assert limits_from_flags({"max_frame_bytes": 1024}).max_frame_bytes == 1024  # parsed by the flag already
    assert ServerLimits(max_frame_bytes=MAX_SIZE).router_max_msg_bytes == MAX_SIZE  # libzmq's MAXMSGSIZE fits
    for bad in (float("inf"), float("nan")):
        with pytest.raises(ValueError, match="max_deadline must be a positive finite number"):
            ServerLimits(max_deadline=bad)
