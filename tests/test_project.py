"""Project invariants: the README's test command is what CI runs; imports point downward."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"```sh\n(.*?)\n```", readme, re.S)
    assert block, "README must start with a sh block of the two set-up commands"
    main_cmd, test_cmd = block.group(1).splitlines()
    assert "zmqflow demo" in main_cmd and "pytest" in test_cmd
    assert test_cmd in (ROOT / ".ci" / "run").read_text()


def test_layers_contract_holds():
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    if exe is None:
        pytest.skip("import-linter is not installed (pip install -e '.[test]')")
    result = subprocess.run([exe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_nothing_near_the_wire_unpickles():
    offenders = [
        str(p.relative_to(ROOT))
        for p in (ROOT / "zmqflow").rglob("*.py")
        if re.search(r"^\s*(import pickle|from pickle)|pickle\.loads|recv_pyobj|send_pyobj", p.read_text(), re.M)
    ]
    assert offenders == []


def test_big_block_tuning_applies_on_glibc():
    import platform

    from zmqflow.transport.memory import keep_big_blocks

    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        pytest.skip("mallopt thresholds exist on glibc only")
    assert keep_big_blocks() is True


def test_free_ports_are_never_handed_out_twice():
    from zmqflow.testing import free_port

    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)


def test_a_task_server_loads_only_what_it_serves():
    """``zmqflow serve`` is the process of every task: it must not carry the client, the training
    loops, the benchmarks or prometheus-client (until metrics are asked for), which cost each task
    start-up time and several MB of resident memory, nor modules only a rare path needs (zipfile for
    old checkpoints, ml_dtypes for bfloat16: 2.6 MB). Public names still resolve on first use."""
    script = (
        "import sys\n"
        "from zmqflow.cli.main import main\n"
        "cmd = main.get_command(None, 'serve')\n"
        "heavy = [m for m in sys.modules if m.startswith(('zmqflow.client', 'zmqflow.training', 'zmqflow.bench',"
        " 'zmqflow.cli.launch', 'prometheus_client', 'rich', 'safetensors', 'ml_dtypes'))]\n"
        "assert cmd.name == 'serve' and not heavy, heavy\n"
        "assert 'zmqflow.state.snapshot' in sys.modules and 'zmqflow.transport.memory' in sys.modules\n"
        "late = [m for m in ('zipfile', 'ctypes.util') if m in sys.modules]  # old checkpoints, finding libc\n"
        "assert not late, late\n"
        "import zmqflow as zf\n"
        "assert zf.Session.__module__ == 'zmqflow.client.blocking'\n"
        "assert callable(zf.checkpoint.checkpoints_iterator) and 'Session' in dir(zf)\n"
        "assert callable(zf.cluster.resolve) and zf.transport.registry.lookup  # subpackages, as eager imports bound them\n"
        "try:\n    zf.NoSuchThing\nexcept AttributeError as e:\n    assert 'NoSuchThing' in str(e)\nelse:\n    raise SystemExit('no error')\n"
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
