"""The in-process engine on CUDA against itself on the CPU (skipped without CUDA).

float32 on CUDA must give the CPU's logits (no TF32: torch leaves it off for matmuls by
default); bfloat16 on CUDA must track the float32 logits the way bfloat16 does on the CPU
(measured on the CPU: mean |diff| about 1.5% of the logits' spread, argmax agreement >= 94%
over these prompts; routing flips in bfloat16 make the max diff large, so it is not checked).
"""

from __future__ import annotations

import pytest
import torch

from raymoe.engine.engine import EngineConfig, LLMEngine
from raymoe.engine.sampling_params import SamplingParams
from tiny_models import ARCHITECTURES, VOCAB, build_reference_model, write_checkpoint

pytestmark = pytest.mark.gpu


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(4, VOCAB, (n,), generator=generator).tolist() for n in (3, 21, 40)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    return {arch: write_checkpoint(build_reference_model(arch), str(tmp_path_factory.mktemp(arch)))
            for arch in ARCHITECTURES}


def score(path: str, dtype: str, device: str) -> torch.Tensor:
    engine = LLMEngine.from_pretrained(path, EngineConfig(dtype=dtype, device=device))
    return torch.cat(engine.score(prompts()))  # [sum(len), V] float32 on the CPU


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_cuda_float32_logits_match_the_cpu(checkpoints, arch):
    cpu = score(checkpoints[arch], "float32", "cpu")
    cuda = score(checkpoints[arch], "float32", "cuda")
    assert cuda.dtype == torch.float32 and cuda.device.type == "cpu"
    assert (cuda - cpu).abs().max().item() < 1e-3, arch


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_cuda_bfloat16_tracks_float32(checkpoints, arch):
    cpu = score(checkpoints[arch], "float32", "cpu")
    cuda = score(checkpoints[arch], "bfloat16", "cuda")
    assert torch.isfinite(cuda).all()
    assert ((cuda - cpu).abs().mean() / cpu.std()).item() < 0.05, arch
    assert (cuda.argmax(-1) == cpu.argmax(-1)).float().mean().item() >= 0.8, arch


def test_cuda_greedy_decode_matches_the_cpu(checkpoints):
    # Prefill, then decode steps with several running sequences (paged KV cache on the GPU).
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outputs = {}
    for device in ("cpu", "cuda"):
        engine = LLMEngine.from_pretrained(checkpoints["mixtral"], EngineConfig(dtype="float32", device=device,
                                                                                block_size=4))
        outputs[device] = [o.output_token_ids for o in engine.generate(prompts(), params)]
    assert outputs["cuda"] == outputs["cpu"]
