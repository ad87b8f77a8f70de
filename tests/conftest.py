"""Shared fixtures: tiny checkpoints written once per session."""

from __future__ import annotations

import os

import pytest

# Ray listeners on loopback only, for every test that starts Ray (must precede ray.init).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


@pytest.fixture(scope="session")
def tiny_mixtral_dir(tmp_path_factory) -> str:
    from tiny_models import build_reference_model, write_checkpoint

    return write_checkpoint(build_reference_model("mixtral"), str(tmp_path_factory.mktemp("tiny-mixtral")))
