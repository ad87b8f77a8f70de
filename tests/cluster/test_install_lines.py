"""The README's install lines: the CPU one resolves no nvidia package.

A dry run (`pip install --dry-run --report`) of the README's torch line, over the package
indexes pip is configured with here. On a machine that reaches PyTorch's CPU index and PyPI
(and nothing else: `--isolated` ignores this machine's local wheel folders), the same dry run
shows the line is what a plain machine gets; where that index does not resolve, that half
says so in its skip reason.
"""

from __future__ import annotations

import json
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from doc_examples import fenced_blocks

CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def torch_lines() -> list[list[str]]:
    """The `pip install torch...` parts of the README's bash blocks, as argument lists."""
    blocks = fenced_blocks("README.md", "bash")
    found = []
    for block in blocks:
        for command in block.split("&&"):
            words = shlex.split(command)
            if words[:3] == ["pip", "install", "torch==2.13.0"]:
                found.append(words[2:])
    return found


def dry_run(arguments: list[str], tmp_path: Path, isolated: bool = False) -> list[dict]:
    report = tmp_path / "report.json"
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
               "--report", str(report), *(["--isolated"] if isolated else []), *arguments]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(report.read_text())["install"]


def test_both_readme_commands_take_torch_from_the_cpu_index():
    lines = torch_lines()
    assert len(lines) == 2, lines  # Run and Test
    for line in lines:
        assert line[1:] == ["--extra-index-url", CPU_INDEX], line


def test_the_cpu_line_resolves_no_nvidia_package_here(tmp_path):
    installs = dry_run(torch_lines()[0], tmp_path)
    names = {item["metadata"]["name"].lower(): item["metadata"]["version"] for item in installs}
    assert names["torch"].endswith("+cpu"), names
    assert not [name for name in names if name.startswith(("nvidia", "triton", "cuda"))], names


def _resolves(host: str) -> bool:
    try:
        socket.getaddrinfo(host, 443)
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _resolves("download.pytorch.org"),
                    reason="PyTorch's CPU index (download.pytorch.org) does not resolve from this machine")
def test_the_cpu_line_resolves_no_nvidia_package_on_a_plain_machine(tmp_path):
    installs = dry_run(torch_lines()[0], tmp_path, isolated=True)
    names = {item["metadata"]["name"].lower(): item["metadata"]["version"] for item in installs}
    assert names["torch"].endswith("+cpu"), names
    assert not [name for name in names if name.startswith(("nvidia", "triton", "cuda"))], names
