"""The design card's top-level folders never shadow an installed distribution.

`python -m pytest`, `python -c`, `python -m raymoe...` and a notebook started in the
repository root all put the root first on sys.path. The folders there (kernels/, moe/,
cluster/, ...) hold no __init__.py, so they are at most namespace portions, which Python's
import system ranks below any regular package of the same name further down sys.path; the
code imports as ``raymoe.<folder>`` through the symlinks in raymoe/ (docs/ARCHITECTURE.md).
transformers imports the `kernels` distribution whenever a model class loads: a regular
package named `kernels` at the root broke every reference model (ImportError CUDAProperties).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CARD_FOLDERS = ("actors", "cluster", "configs", "engine", "kernels", "moe")


def _under_repo(path: str | None) -> bool:
    return path is not None and Path(path).resolve().is_relative_to(REPO)


def _top_level_folders() -> list[str]:
    """Every folder at the root that Python could import by its name, less raymoe/ (the one package we ship)."""
    return sorted(entry.name for entry in REPO.iterdir() if entry.is_dir() and entry.name.isidentifier()
                  and not entry.name.startswith(("_", ".")) and entry.name != "raymoe")


def test_transformers_and_the_kernels_distribution_import_from_the_repository_root():
    """`python -c` from the root (sys.path[0] is the root): the installed `kernels` wins."""
    code = ("import transformers, kernels; from transformers import AutoModelForCausalLM, MixtralForCausalLM; "
            "import transformers.integrations.hub_kernels; print(kernels.__file__)")
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    location = result.stdout.strip().splitlines()[-1]
    assert not _under_repo(location), f"`kernels` came from the checkout: {location}"


def test_in_this_process_kernels_is_the_distribution():
    """Under the README's test command itself (the root and tests/ on sys.path)."""
    assert any(_under_repo(entry or ".") for entry in sys.path), "the test should run with the root on sys.path"
    import kernels
    import transformers.integrations.hub_kernels  # noqa: F401  (imports `kernels`' CUDAProperties)

    assert not _under_repo(kernels.__file__), kernels.__file__
    assert importlib.metadata.distribution("kernels").files is not None


def test_no_top_level_folder_is_a_regular_package():
    """A regular package at the root would shadow any distribution of its name, installed now or later."""
    packages = [name for name in _top_level_folders() if (REPO / name / "__init__.py").exists()]
    assert packages == [], f"top-level folders with an __init__.py (they shadow distributions): {packages}"


def test_no_top_level_folder_shadows_an_installed_distribution():
    """Every top-level import name an installed distribution provides resolves to that distribution."""
    provided = importlib.metadata.packages_distributions()
    clashes = [name for name in _top_level_folders() if name in provided]
    assert "kernels" in clashes, "the `kernels` distribution (transformers needs it) should be installed here"
    for name in clashes:
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.origin is not None, f"{name}: resolved to a namespace, not {provided[name]}"
        assert not _under_repo(spec.origin), f"{name} resolves to the checkout ({spec.origin}), not {provided[name]}"


def test_raymoe_subpackages_are_the_card_folders():
    """raymoe.<folder> is the top-level folder (through raymoe/<folder> -> ../<folder>), for every folder."""
    for name in CARD_FOLDERS:
        link = REPO / "raymoe" / name
        assert link.is_symlink() and link.resolve() == REPO / name, f"raymoe/{name} should link to ../{name}"
        module = importlib.import_module(f"raymoe.{name}")
        assert [Path(path).resolve() for path in module.__path__] == [REPO / name]
