"""Cluster config: loading, defaults, round trip, and one clear error per problem."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from doc_examples import fenced_block
from raymoe.cluster.config import (
    ClusterConfig,
    CommBackend,
    ConfigError,
    Device,
    DType,
    NodeStrategy,
    OverflowPolicy,
    PlacementStrategy,
    load_cluster_config,
    parse_cluster_config,
)

EXAMPLES = Path(__file__).resolve().parents[2] / "configs" / "examples"

# The README's cluster config ("Cluster configs"), read from its yaml block as written, and its
# model line and path.
MINIMUM = fenced_block("README.md", "yaml", "expert_workers:")
MODEL_LINE = next(line for line in MINIMUM.splitlines(keepends=True) if line.startswith("model:"))
MODEL = MODEL_LINE.split("#")[0].split(":", 1)[1].strip()


def write(tmp_path: Path, text: str, name: str = "cluster.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_minimum_loads_exactly_as_written(tmp_path):
    config = load_cluster_config(write(tmp_path, MINIMUM))
    assert config.model == os.path.expanduser(MODEL)
    assert config.device is Device.CPU and config.dtype is DType.FLOAT32
    assert (config.routers, config.expert_workers) == (2, 3)
    assert config.placement.strategy is PlacementStrategy.ROUND_ROBIN
    assert config.placement.redundant_slots_per_worker == 1
    assert config.placement.node_strategy is NodeStrategy.PACK
    assert config.placement.experts is None and config.placement.layers is None
    assert (config.serve.host, config.serve.port) == ("127.0.0.1", 8000)
    # Defaults of the sections the minimum leaves out.
    assert config.comm.backend is CommBackend.AUTO and config.comm.timeout_s == 30.0
    assert config.capacity.factor == 1.0 and config.capacity.overflow is OverflowPolicy.NONE
    engine = config.engine
    assert (engine.max_num_seqs, engine.max_num_batched_tokens, engine.block_size) == (256, None, 16)
    assert engine.enable_prefix_caching is True
    assert engine.max_model_len is None and engine.kv_cache_bytes == 512 * 2**20


@pytest.mark.parametrize("comm, limit_s", [("", 10.0), ("comm: {timeout_s: 3}\n", 2.4),
                                            ("comm: {timeout_s: 3, wedge_after_s: 1.5}\n", 1.5),
                                            ("comm: {wedge_after_s: 20}\n", 20.0)])
def test_the_wedge_limit_is_a_fraction_of_the_deadline_at_most_10_s_unless_set(comm, limit_s):
    """A frozen rank holds every other rank until the rank watch's limit: the default 30 s
    deadline (for slow steps) must not mean 24 s of that (actors/rank_watch.py)."""
    assert load_cluster_config(MINIMUM + comm).comm.wedge_limit_s() == pytest.approx(limit_s)


def test_only_model_is_required():
    config = parse_cluster_config({"model": "/m"})
    assert config.device is Device.AUTO and config.dtype is DType.AUTO
    assert (config.routers, config.expert_workers) == (1, 1)
    assert config.placement.strategy is PlacementStrategy.CONTIGUOUS
    assert config.placement.redundant_slots_per_worker == 0


def test_text_and_path_give_the_same_config(tmp_path):
    assert load_cluster_config(MINIMUM) == load_cluster_config(str(write(tmp_path, MINIMUM)))


def test_to_dict_round_trips_and_is_json(tmp_path):
    text = explicit("{0: [0, 1], 2: [2, 3]}", "  layers: {1: {0: [3], 1: [2], 2: [0, 1]}}\n")
    text += "comm: {backend: gloo, timeout_s: 5}\n"
    text += "capacity: {factor: 1.25, overflow: drop}\nengine: {max_model_len: 512}\n"
    config = load_cluster_config(write(tmp_path, text))
    data = config.to_dict()
    assert data["placement"]["strategy"] == "explicit" and data["comm"]["backend"] == "gloo"
    assert data["capacity"]["overflow"] == "drop" and data["placement"]["node_strategy"] == "PACK"
    assert data["placement"]["layers"] == {1: {0: [3], 1: [2], 2: [0, 1]}}
    json.dumps(data)
    assert parse_cluster_config(data) == config
    with pytest.raises(Exception):
        config.routers = 5  # frozen


def test_relative_model_path_resolves_against_the_file(tmp_path):
    (tmp_path / "sub").mkdir()
    path = write(tmp_path / "sub", MINIMUM.replace(MODEL, "../ckpt/demo"))
    assert load_cluster_config(path).model == str(tmp_path / "ckpt" / "demo")


def test_relative_model_path_with_base_dir_and_home(tmp_path, monkeypatch):
    text = MINIMUM.replace(MODEL, "demo")
    assert load_cluster_config(text, base_dir=tmp_path).model == str(tmp_path / "demo")
    assert parse_cluster_config({"model": "./a/../b"}, base_dir="/x").model == "/x/b"
    monkeypatch.setenv("HOME", str(tmp_path))
    assert parse_cluster_config({"model": "~/ckpt"}).model == os.path.join(str(tmp_path), "ckpt")


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_example_configs_load(path):
    config = load_cluster_config(path)
    assert isinstance(config, ClusterConfig)
    table = config.initial_placement(num_layers=2, num_experts=8)
    assert table.num_workers == config.expert_workers


def test_examples_exist():
    assert {p.name for p in EXAMPLES.glob("*.yaml")} >= {"cpu-2x3.yaml", "explicit-per-layer.yaml"}


def test_explicit_example_shape():
    config = load_cluster_config(EXAMPLES / "explicit-per-layer.yaml")
    assert config.placement.experts == {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}
    table = config.initial_placement(num_layers=2, num_experts=8)
    assert table.worker_experts(1, 0)[:4] == [0, 2, 4, 6]
    assert table.worker_experts(0, 1)[:4] == [4, 5, 6, 7]


def in_placement(lines: str, strategy: str = "round_robin") -> str:
    """MINIMUM with ``lines`` added to its placement section."""
    text = MINIMUM.replace("strategy: round_robin", f"strategy: {strategy}")
    return text.replace("redundant_slots_per_worker: 1\n", "redundant_slots_per_worker: 1\n" + lines)


def explicit(experts: str, extra: str = "") -> str:
    return in_placement(f"  experts: {experts}\n" + extra, "explicit")


@pytest.mark.parametrize(
    "text, message",
    [
        (
            MINIMUM.replace("strategy: round_robin", "strategy: diagonal"),
            "placement.strategy: expected one of contiguous, round_robin, explicit; got 'diagonal'",
        ),
        (MINIMUM.replace("routers: 2", "routers: 0"), "routers: expected an integer >= 1; got 0"),
        (MINIMUM.replace("routers: 2", "routers: two"), "routers: expected an integer >= 1; got 'two'"),
        (MINIMUM.replace("routers: 2", "routers: 2.5"), "routers: expected an integer >= 1; got 2.5"),
        (MINIMUM.replace("expert_workers: 3", "expert_workers: 0"), "expert_workers: expected an integer >= 1; got 0"),
        (MINIMUM.replace("redundant_slots_per_worker: 1", "redundant_slots_per_worker: -1"),
         "placement.redundant_slots_per_worker: expected an integer >= 0; got -1"),
        (MINIMUM.replace("redundant_slots_per_worker: 1", "bogus: 1"), "placement.bogus: unknown field"),
        (MINIMUM + "roters: 2\n", "roters: unknown field"),
        (MINIMUM.replace("port: 8000", "port: 0"), "serve.port: expected an integer in 1..65535; got 0"),
        (MINIMUM.replace("port: 8000", "port: 65536"), "serve.port: expected an integer in 1..65535; got 65536"),
        (MINIMUM.replace("device: cpu", "device: tpu"), "device: expected one of auto, cpu, cuda; got 'tpu'"),
        (MINIMUM.replace("dtype: float32", "dtype: fp8"), "dtype: expected one of auto, float32, bfloat16, float16; got 'fp8'"),
        (MINIMUM.replace(MODEL_LINE, ""), "model: required field is missing"),
        (MINIMUM + "comm: {timeout_s: 0}\n", "comm.timeout_s: expected a number > 0; got 0"),
        (MINIMUM + "comm: {wedge_after_s: 0}\n", "comm.wedge_after_s: expected a number > 0 or null; got 0"),
        (MINIMUM + "comm: {backend: mpi}\n", "comm.backend: expected one of auto, nccl, gloo, sockets; got 'mpi'"),
        (MINIMUM + "capacity: {factor: -0.5}\n", "capacity.factor: expected a number > 0; got -0.5"),
        (MINIMUM + "capacity: {overflow: spill}\n", "capacity.overflow: expected one of none, drop; got 'spill'"),
        (MINIMUM + "engine: {max_model_len: 0}\n", "engine.max_model_len: expected an integer >= 1 or null; got 0"),
        (MINIMUM + "engine: {block_size: 0}\n", "engine.block_size: expected an integer >= 1; got 0"),
        (MINIMUM.replace("  redundant_slots_per_worker: 1", "  node_strategy: pack"),
         "placement.node_strategy: expected one of PACK, SPREAD, STRICT_SPREAD; got 'pack'"),
        (MINIMUM.replace("strategy: round_robin", "strategy: explicit"), "placement.experts: required when placement.strategy is explicit"),
        (in_placement("  experts: {0: [1]}\n"),
         "placement.experts: only allowed with placement.strategy explicit; got strategy 'round_robin'"),
        (in_placement("  layers: {0: {0: [1]}}\n"),
         "placement.layers: only allowed with placement.strategy explicit; got strategy 'round_robin'"),
        (explicit("{0: [0, 1], 3: [2]}"), "placement.experts.3: worker 3 does not exist (expert_workers: 3"),
        (explicit("{0: [0, 1], 1: []}"), "placement.experts.1: expected a non-empty list of expert ids; got []"),
        (explicit("{}"), "placement.experts: expected a mapping of worker id -> list of experts; got {}"),
        (explicit("{0: [0, 1, 0]}"), "placement.experts.0: experts listed more than once: [0]"),
        (explicit("{0: [0, x]}"), "placement.experts.0[1]: expected an integer >= 0; got 'x'"),
        (explicit("{0: [0], a: [1]}"), "placement.experts: expected each key to be an integer >= 0; got 'a'"),
        (explicit("[0, 1]"), "placement.experts: expected a mapping or null; got [0, 1]"),
        (explicit("{0: [0, 1]}", "  layers: {2: {0: [0], 1: [-1]}}\n"),
         "placement.layers.2.1[0]: expected an integer >= 0; got -1"),
        (explicit("{0: [0, 1]}", "  layers: {2: {0: [0], 7: [1]}}\n"),
         "placement.layers.2.7: worker 7 does not exist"),
        (explicit("{0: [0, 1]}", "  layers: {2: {0: [1, 1]}}\n"), "placement.layers.2.0: experts listed more than once: [1]"),
        (MINIMUM + "serve: {port: 1}\n",
         f"line {MINIMUM.count(chr(10)) + 1}, column 1: invalid YAML: key 'serve' appears twice"),
        ("model: x\nplacement: []\n", "placement: expected a mapping; got []"),
    ],
    ids=lambda value: value.split(":")[0] if "\n" not in value else "",
)
def test_errors_name_the_yaml_path(tmp_path, text, message):
    path = write(tmp_path, text, "bad.yaml")
    with pytest.raises(ConfigError) as info:
        load_cluster_config(path)
    assert str(info.value).startswith(f"{path}: {message}"), str(info.value)


GLOO_ON_CUDA = (
    "comm.backend: gloo moves CPU tensors only, so it cannot serve device: cuda; "
    "set comm.backend: nccl (or auto) for GPUs, or device: cpu to keep gloo"
)


@pytest.mark.parametrize("comm", ["comm: {backend: gloo}\n", "comm:\n  backend: gloo\n  timeout_s: 5\n"])
def test_gloo_with_cuda_is_refused_at_load(tmp_path, comm):
    # Deployed, every collective on GPU activations would fail and recovery would retry forever.
    path = write(tmp_path, MINIMUM.replace("device: cpu", "device: cuda") + comm, "bad.yaml")
    with pytest.raises(ConfigError) as info:
        load_cluster_config(path)
    assert str(info.value) == f"{path}: {GLOO_ON_CUDA}"
    with pytest.raises(ConfigError, match=r"^<config>: comm\.backend: gloo .* device: cuda"):
        parse_cluster_config({"model": "/m", "device": "cuda", "comm": {"backend": "gloo"}})


def test_sockets_with_cuda_is_refused_at_load():
    with pytest.raises(ConfigError, match=r"^<config>: comm\.backend: sockets moves CPU tensors only, so it cannot "
                                          r"serve device: cuda; .* or device: cpu to keep sockets$"):
        parse_cluster_config({"model": "/m", "device": "cuda", "comm": {"backend": "sockets"}})
    assert parse_cluster_config({"model": "/m", "device": "cpu", "comm": {"backend": "sockets"}}).comm.backend.value == "sockets"


def test_gloo_with_cuda_is_refused_with_an_explicit_placement_too():
    # The explicit-placement checks take another branch of the cross-field checks.
    text = explicit("{0: [0, 1], 2: [2, 3]}").replace("device: cpu", "device: cuda") + "comm: {backend: gloo}\n"
    with pytest.raises(ConfigError, match="comm.backend: gloo moves CPU tensors only"):
        load_cluster_config(text)


@pytest.mark.parametrize(
    "device, backend",
    [("cuda", "nccl"), ("cuda", "auto"), ("cpu", "gloo"), ("cpu", "auto"), ("auto", "gloo"), ("auto", "auto"),
     ("auto", "nccl")],
)
def test_device_and_backend_combinations_that_load(device, backend):
    # device auto resolves at deploy time (where the backend follows it), so gloo is allowed there.
    config = parse_cluster_config({"model": "/m", "device": device, "comm": {"backend": backend}})
    assert config.device is Device(device) and config.comm.backend is CommBackend(backend)


def test_yaml_syntax_error_names_the_line(tmp_path):
    path = write(tmp_path, "model: /m\nplacement: {strategy: contiguous\nrouters: 2\n")
    with pytest.raises(ConfigError, match=r"cluster\.yaml: line 3, column \d+: invalid YAML"):
        load_cluster_config(path)


def test_bad_indentation_is_a_yaml_error():
    with pytest.raises(ConfigError, match=r"^<string>: line 2, column 10: invalid YAML: mapping values"):
        load_cluster_config("model: x\n  routers: 2\n")


@pytest.mark.parametrize(
    "text, message",
    [("\n", "the config is empty"), ("- 1\n- 2\n", "expected a mapping at the top level; got list")],
)
def test_top_level_must_be_a_mapping(text, message):
    with pytest.raises(ConfigError, match=f"^<string>: {message}"):
        load_cluster_config(text)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="nope.yaml: cannot read config"):
        load_cluster_config(tmp_path / "nope.yaml")


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)
    with pytest.raises(ValueError, match=r"^<config>: routers"):
        parse_cluster_config({"model": "/m", "routers": True})


def test_cpu_allocator_defaults_to_jemalloc_and_names_a_bad_value():
    assert parse_cluster_config({"model": "/m"}).cpu.allocator.value == "jemalloc"
    assert parse_cluster_config({"model": "/m", "cpu": {"allocator": "system"}}).cpu.allocator.value == "system"
    with pytest.raises(ConfigError, match=r"cpu\.allocator"):
        parse_cluster_config({"model": "/m", "cpu": {"allocator": "tcmalloc"}})
