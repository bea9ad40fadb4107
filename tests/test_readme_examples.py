"""The README's PyTorch and JAX examples run as written, on two ranks under ``zmqflow launch``."""

from __future__ import annotations

import pathlib
import re

import pytest

from .conftest import launch_script

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def example(heading: str) -> str:
    """The first python block under ``## heading``."""
    text = README.read_text()
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.parametrize("heading, module", [("PyTorch", "torch"), ("JAX", "jax")])
def test_the_readme_example_trains_on_two_ranks(tmp_path, procs, heading, module):
    pytest.importorskip(module)
    p = launch_script(procs, tmp_path / "train.py", example(heading), workers=2, ps=2)
    assert p.wait(100) == 0, p.output
    for rank in (0, 1):
        line = p.wait_for_line(f"rank {rank}/2 loss ", 1)
        assert float(line.rsplit(" ", 1)[1]) < 10.0, line  # a number, and training did not diverge
