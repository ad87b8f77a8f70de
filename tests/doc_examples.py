"""Examples read from the docs themselves: a test runs what a reader copies out of README.md or
docs/*.md, never a copy of it kept in the test (a copy drifts: the README's cluster config
named the demo checkpoint while tests/cluster/test_config.py still tested its old text)."""

from __future__ import annotations

import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def fenced_blocks(doc: str, language: str) -> list[str]:
    """The bodies of the ```LANGUAGE blocks of ``doc`` (a path from the repository root), in order."""
    text = (REPO / doc).read_text()
    return re.findall(rf"^```{re.escape(language)}\n(.*?)^```", text, flags=re.S | re.M)


def fenced_block(doc: str, language: str, containing: str) -> str:
    """The one ```LANGUAGE block of ``doc`` that holds ``containing``."""
    found = [block for block in fenced_blocks(doc, language) if containing in block]
    assert len(found) == 1, f"{doc}: {len(found)} ```{language} blocks hold {containing!r}, expected 1"
    return found[0]


def curl_body(doc: str, path: str) -> dict:
    """The JSON body (``-d '...'``) of the first `curl` to ``path`` (e.g. "/v1/completions") in
    the bash blocks of ``doc``."""
    for block in fenced_blocks(doc, "bash"):
        match = re.search(rf"curl [^\n]*{re.escape(path)}\b.*?-d '(.*?)'", block, flags=re.S)
        if match:
            return json.loads(match.group(1))
    raise AssertionError(f"{doc}: no curl to {path} with a -d body in its bash blocks")
