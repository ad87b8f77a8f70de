"""A layer's attention block in one native call (kernels/attention_block.py) against the calls one
by one (engine/model.py): the same tokens and the same logprobs, bit for bit, at every decode
step, for one sequence and for batches whose sequences join and leave at different steps; with a
QKV bias (Qwen2-MoE), a sliding window (Mixtral), and a block size that splits contexts over
blocks. Where the block does not apply (q/k norms: Qwen3-MoE, OLMoE) the model runs the calls."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from raymoe.engine.engine import EngineConfig, LLMEngine
from raymoe.engine.model import MoEModel
from raymoe.engine.sampling_params import SamplingParams
from raymoe.kernels import attention_block, native_library

from tiny_models import build_reference_model, write_checkpoint

pytestmark = pytest.mark.skipif(native_library.unavailable_reason() is not None,
                                reason=f"native kernels unavailable: {native_library.unavailable_reason()}")

CASES = {  # name: (architecture, config overrides, whether the block applies)
    "mixtral": ("mixtral", {}, True),
    "mixtral-sliding-window": ("mixtral", {"sliding_window": 6}, True),
    "qwen2_moe-qkv-bias": ("qwen2_moe", {}, True),
    "qwen3_moe-qk-norm": ("qwen3_moe", {}, False),
}


def prompts(count: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 300, (int(n),), generator=generator).tolist()
            for n in torch.randint(2, 14, (count,), generator=generator)]


def run(path: str, one_call: bool, calls: list[int]) -> list[tuple[list[int], list[float]]]:
    engine = LLMEngine.from_pretrained(path, EngineConfig(dtype="float32", block_size=4))
    engine.model.one_call_attention = one_call
    original = attention_block.attention_block

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    attention_block.attention_block = counted
    try:
        outputs = []
        for batch, max_tokens in ((prompts(1, 0), 9), (prompts(5, 1), 11)):
            params = [SamplingParams(max_tokens=max_tokens - i, temperature=0.0, ignore_eos=True, logprobs=2)
                      for i in range(len(batch))]  # different lengths: sequences leave at different steps
            outputs += [(o.output_token_ids, o.output_logprobs) for o in engine.generate(batch, params)]
        return outputs
    finally:
        attention_block.attention_block = original


@pytest.mark.parametrize("case", CASES)
def test_one_call_equals_the_calls_one_by_one_bit_for_bit(case, tmp_path):
    arch, overrides, applies = CASES[case]
    path = write_checkpoint(build_reference_model(arch, seed=3, **overrides), str(tmp_path / case))
    fused_calls, plain_calls = [0], [0]
    fused = run(path, True, fused_calls)
    plain = run(path, False, plain_calls)
    assert plain_calls[0] == 0
    assert (fused_calls[0] > 0) == applies, fused_calls
    assert fused == plain


def test_the_model_class_default_is_one_call():
    assert MoEModel.one_call_attention is True



def test_a_layer_whose_weights_the_call_cannot_read_turns_the_block_off_for_the_step(tmp_path):
    """The C call takes every layer's weight pointers as float32: one layer in another dtype (here
    the last one's output projection) must send the step through the calls one by one, not hand
    the call bf16 bytes read as float32 (plan once checked layer 0 alone). The same decode step's
    plan arguments, recorded in a float32 run, with and without that one layer changed."""
    path = write_checkpoint(build_reference_model("mixtral", seed=3), str(tmp_path / "mixtral"))
    engine = LLMEngine.from_pretrained(path, EngineConfig(dtype="float32", block_size=4))
    original, seen = attention_block.plan, []

    def recording(*args, **kwargs):
        block = original(*args, **kwargs)
        if block is not None:
            seen.append(args)
        return block

    attention_block.plan = recording
    try:
        engine.generate(prompts(2, 5), SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    finally:
        attention_block.plan = original
    assert seen, "no decode step planned the block: the control failed"
    *shared, layers = seen[-1]
    assert original(*shared, layers) is not None
    last = layers[-1]
    bf16 = dataclasses.replace(last, attention=dataclasses.replace(last.attention,
                                                                   o_proj=last.attention.o_proj.to(torch.bfloat16)))
    assert original(*shared, [*layers[:-1], bf16]) is None
