"""Checkpoint reading and validation, tokenizer and chat template, the demo checkpoint."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from raymoe.engine.checkpoint import Checkpoint, CheckpointError
from raymoe.engine.demo_model import write_demo_model
from raymoe.engine.engine import EngineConfig, LLMEngine
from raymoe.engine.sampling_params import SamplingParams
from raymoe.engine.tokenizer import ChatTemplateError, Tokenizer
from raymoe.engine.weights import validate_checkpoint
from raymoe.engine.hf_config import load_model_config
from tiny_models import build_reference_model, write_checkpoint


def test_sharded_checkpoint_reads_every_tensor(tmp_path):
    model = build_reference_model("olmoe")
    path = write_checkpoint(model, str(tmp_path), shard=True)
    assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
    checkpoint = Checkpoint(path)
    state = model.state_dict()
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    assert torch.equal(checkpoint.get(name), state["model.layers.1.mlp.experts.gate_up_proj"][3, 48:])
    validate_checkpoint(checkpoint, load_model_config(path))


def corrupt(path: str, edit) -> None:
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file)


def test_missing_tensor_is_refused_before_loading(tiny_mixtral_dir, tmp_path):
    path = str(tmp_path / "ckpt")
    write_checkpoint(build_reference_model("mixtral"), path)
    corrupt(path, lambda t: t.pop("model.layers.1.block_sparse_moe.experts.5.w2.weight"))
    with pytest.raises(CheckpointError, match="1 tensors missing.*experts.5.w2"):
        LLMEngine.from_pretrained(path)


def test_wrong_shape_is_refused_naming_the_tensor(tmp_path):
    path = str(tmp_path / "ckpt")
    write_checkpoint(build_reference_model("qwen3_moe"), path)
    corrupt(path, lambda t: t.update({"model.layers.0.self_attn.q_norm.weight": torch.ones(7)}))
    with pytest.raises(CheckpointError, match=r"q_norm.weight: \(7,\) \(config expects \(24,\)\)"):
        LLMEngine.from_pretrained(path)


def test_no_safetensors_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        Checkpoint(str(tmp_path))


def test_tokenizer_round_trips_and_renders_chat(tiny_mixtral_dir):
    tokenizer = Tokenizer(tiny_mixtral_dir)
    text = "Hello world, the experts route tokens!"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_missing_chat_template_is_a_clear_error(tiny_mixtral_dir, tmp_path):
    for name in ("tokenizer.json",):
        (tmp_path / name).write_bytes(open(os.path.join(tiny_mixtral_dir, name), "rb").read())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    with pytest.raises(ChatTemplateError, match="no chat template"):
        Tokenizer(str(tmp_path)).apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_demo_checkpoint_serves(arch, tmp_path):
    path = write_demo_model(str(tmp_path / arch), arch)
    engine = LLMEngine.from_pretrained(path, EngineConfig(dtype="float32"))
    tokenizer = Tokenizer(path)
    out = engine.generate([tokenizer.encode("Hello")], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert len(out[0].output_token_ids) == 5
    assert load_model_config(path).architecture.name.lower() == arch.upper().lower().replace("_moe", "_moe")
