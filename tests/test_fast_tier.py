"""The fast tier (`python -m pytest -m fast`, tests/fast_tier.py) names only tests that exist:
every entry's file, class and function are there (read with ast, so this holds whichever
tests ran), and an entry with parameters matches a test whenever its file was collected."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from fast_tier import FAST_TIER, UNMATCHED

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.fast


def defined(body: list[ast.stmt], name: str) -> ast.stmt | None:
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    return next((node for node in body if isinstance(node, kinds) and node.name == name), None)


@pytest.mark.parametrize("entry", FAST_TIER)
def test_each_entry_names_a_test_function_that_exists(entry):
    path, *names = entry.split("::")
    assert path.startswith("tests/") and names, f"{entry}: expected tests/PATH.py::[Class::]test_name[params]"
    file = ROOT / path
    assert file.is_file(), f"{entry}: no file {path}"
    names[-1] = names[-1].split("[", 1)[0]
    assert names[-1].startswith("test_"), f"{entry}: {names[-1]} is not a test function"
    body = ast.parse(file.read_text(), str(file)).body
    for name in names:
        node = defined(body, name)
        assert node is not None, f"{entry}: {path} defines no {name}"
        body = getattr(node, "body", [])


def test_no_entry_twice():
    assert len(set(FAST_TIER)) == len(FAST_TIER), sorted(e for e in FAST_TIER if FAST_TIER.count(e) > 1)


def test_every_entry_matched_a_test_where_its_file_was_collected(request):
    # a parameter id that no longer exists leaves its function in place: this catches it
    assert request.config.stash.get(UNMATCHED, []) == []
