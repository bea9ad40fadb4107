"""The rendered manifests stay one well-formed YAML stream whatever text --command carries."""

from __future__ import annotations

import shlex
import shutil
import subprocess

import pytest
from click.testing import CliRunner

from zmqflow.cli.main import main
from zmqflow.deploy.k8s import K8sOptions, render, render_yaml
from zmqflow.errors import InvalidArgument

kv = pytest.importorskip("kubernetes_validate")
yaml = pytest.importorskip("yaml")

VERSION = "1.37"
# every line break YAML knows, text that would be a new document or key if it escaped its line,
# and characters YAML escapes or reads without surrogate pairs
COMMANDS = [
    ("python", "-c", "import sys\nprint(sys.argv)"),
    ("sh", "-c", "echo a\r\necho b\recho c"),
    ("sh", "-c", "x\n---\napiVersion: v1\nkind: Secret\nmetadata: {name: injected}"),
    ("echo", "a\x85b", "c\u2028d", "e\u2029f", "tab\there", "back\\slash", "quote'\"", "smile \U0001F600"),
    ("echo", "bell\x07", "del\x7f", "bom\ufeff", "# not a comment", "- not an item"),
]


@pytest.mark.parametrize("command", COMMANDS, ids=range(len(COMMANDS)))
def test_any_command_text_keeps_one_valid_stream(command: tuple[str, ...]) -> None:
    opts = K8sOptions(image="ghcr.io/acme/train:1.2", workers=2, ps=1, chief=True, command=command)
    docs = render(opts)
    for doc in docs:
        kv.validate(doc, VERSION, strict=True)
    text = render_yaml(opts)
    parsed = list(yaml.safe_load_all(text))
    assert len(parsed) == len(docs) and parsed == docs
    jobs = [d for d in parsed if d["kind"] == "Job" and d["metadata"]["name"] != "zmqflow-ps"]
    assert [tuple(j["spec"]["template"]["spec"]["containers"][0]["command"]) for j in jobs] == [command] * 2
    head = text[:text.index("\n---\n")].split("\n")
    assert all(line.startswith("#") for line in head), head
    assert head[0].startswith("# Rendered by: zmqflow deploy k8s ")


@pytest.mark.skipif(shutil.which("bash") is None, reason="the header's $'...' quoting is bash's")
@pytest.mark.parametrize("command", COMMANDS[:4], ids=range(4))
def test_the_header_line_reproduces_the_manifests(command: tuple[str, ...]) -> None:
    """The 'Rendered by' comment stays one line and, read by a shell, renders the same text."""
    text = render_yaml(K8sOptions(image="img:1", command=command))
    first = text.split("\n", 1)[0].removeprefix("# Rendered by: zmqflow ")
    argv = subprocess.run(["bash", "-c", f"printf '%s\\0' {first}"], capture_output=True, check=True,
                          timeout=30).stdout.decode().split("\0")[:-1]
    assert shlex.split(argv[argv.index("--command") + 1]) == list(command)
    result = CliRunner().invoke(main, argv)
    assert result.exit_code == 0, result.output
    assert result.stdout == text


def test_cli_renders_a_multi_line_command() -> None:
    result = CliRunner().invoke(main, ["deploy", "k8s", "--image", "img:1", "--command", "python -c 'a\nb'"])
    assert result.exit_code == 0, result.output
    docs = list(yaml.safe_load_all(result.stdout))
    container = docs[-1]["spec"]["template"]["spec"]["containers"][0]
    assert len(docs) == 4 and container["command"] == ["python", "-c", "a\nb"]


def test_a_command_no_process_can_take_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="command argument 'a\\\\x00b'"):
        K8sOptions(image="img:1", command=("echo", "a\x00b"))
    with pytest.raises(InvalidArgument, match="UTF-8"):
        K8sOptions(image="img:1", command=("echo", "\udcff"))
