"""Configs that would cost a lot before their error: non-UTF-8 bytes, YAML alias bombs."""

from __future__ import annotations

import time

import pytest

from raymoe.cluster.config import ConfigError, load_cluster_config

LEVELS = "abcdefghi"


def alias_bomb() -> str:
    """Nine levels of nine aliases: ~400 bytes that expand to 9**9 strings."""
    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for previous, name in zip(LEVELS, LEVELS[1:]):
        lines.append(f"{name}: &{name} [" + ",".join([f"*{previous}"] * 9) + "]")
    return "\n".join(lines) + "\nmodel: /m\n"


def test_an_alias_bomb_is_refused_before_it_expands():
    started = time.perf_counter()
    with pytest.raises(ConfigError, match="aliases"):
        load_cluster_config(alias_bomb())
    assert time.perf_counter() - started < 1.0  # refused while composing, not after expanding


def test_a_few_aliases_still_work():
    assert load_cluster_config("model: /m\nserve: &s {port: 8001}\nx_ignored: null\n".replace("x_ignored: null\n", "")
                               ).serve.port == 8001


def test_non_utf8_bytes_name_the_file_and_the_byte(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"model: /m\nserve:\n  served_model_name: caf\xe9\n")
    with pytest.raises(ConfigError, match=r"latin1.yaml: a config must be UTF-8 text; byte 41"):
        load_cluster_config(str(path))
