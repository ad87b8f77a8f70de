"""`raymoe run-batch` in the OpenAI batch format, against the in-process engine."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from raymoe.cluster.cli import main
from raymoe.engine.engine import EngineConfig, LLMEngine
from raymoe.engine.sampling_params import SamplingParams
from raymoe.engine.tokenizer import Tokenizer


def write_jsonl(path, items):
    path.write_text("".join(json.dumps(item) + "\n" for item in items))


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def openai_token(tokenizer: Tokenizer, token: int) -> str:
    """A byte-level token as OpenAI names it, from transformers' byte alphabet (the reference):
    its text, or ``bytes:\\xNN...`` when it is only part of a character."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = {char: byte for byte, char in bytes_to_unicode().items()}
    data = bytes(alphabet[c] for c in tokenizer.id_to_token(token))
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


@pytest.fixture(scope="module")
def batch_result(tiny_mixtral_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("batch")
    items = [
        {"custom_id": "text", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "Hello world", "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                  "return_token_ids": True}},
        {"custom_id": "ids", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": [10, 11, 12, 13], "max_tokens": 5, "temperature": 0, "ignore_eos": True,
                  "return_token_ids": True, "logprobs": 2}},
        {"custom_id": "sampled", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "The sea", "max_tokens": 8, "temperature": 0.8, "top_p": 0.9, "top_k": 20,
                  "seed": 7, "ignore_eos": True, "return_token_ids": True}},
        {"custom_id": "bad-range", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": [1, 99999], "max_tokens": 4}},
        {"custom_id": "bad-type", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "x", "max_tokens": "many"}},
        {"custom_id": "bad-url", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}},
    ]
    source, target = folder / "in.jsonl", folder / "out.jsonl"
    write_jsonl(source, items)
    code = main(["run-batch", "-i", str(source), "-o", str(target), "--model", tiny_mixtral_dir])
    return code, items, read_jsonl(target)


def test_output_lines_follow_the_batch_format_in_input_order(batch_result):
    code, items, lines = batch_result
    assert code == 0
    assert [line["custom_id"] for line in lines] == [item["custom_id"] for item in items]
    for line in lines:
        assert set(line) == {"id", "custom_id", "response", "error"}
        assert set(line["response"]) >= {"status_code", "body"}
    assert [line["response"]["status_code"] for line in lines] == [200, 200, 200, 400, 400, 404]


def test_completions_equal_the_engine_and_carry_token_ids(batch_result, tiny_mixtral_dir):
    _, items, lines = batch_result
    engine = LLMEngine.from_pretrained(tiny_mixtral_dir, EngineConfig(dtype="float32"))
    tokenizer = Tokenizer(tiny_mixtral_dir)
    for line in lines[:3]:
        body = line["response"]["body"]
        choice = body["choices"][0]
        request = next(i["body"] for i in items if i["custom_id"] == line["custom_id"])
        prompt = request["prompt"] if isinstance(request["prompt"], list) else tokenizer.encode(request["prompt"])
        assert choice["prompt_token_ids"] == prompt
        params = SamplingParams(max_tokens=request["max_tokens"], temperature=request["temperature"],
                                top_p=request.get("top_p", 1.0), top_k=request.get("top_k", -1),
                                seed=request.get("seed"), ignore_eos=True)
        expected = engine.generate([prompt], params)[0].output_token_ids
        assert choice["token_ids"] == expected
        assert choice["text"] == tokenizer.decode(expected)
        assert choice["finish_reason"] == "length"
        assert body["object"] == "text_completion"
        assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": len(expected),
                                 "total_tokens": len(prompt) + len(expected)}


def test_logprobs_are_the_log_softmax_of_transformers_logits(batch_result, tiny_mixtral_dir):
    """Against an independent reference: transformers' own forward over the prompt and the
    answer, log_softmax in float64 (not the engine, not its sampler)."""
    from transformers import AutoModelForCausalLM

    _, items, lines = batch_result
    choice = lines[1]["response"]["body"]["choices"][0]
    prompt, output = items[1]["body"]["prompt"], choice["token_ids"]
    model = AutoModelForCausalLM.from_pretrained(tiny_mixtral_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + output])).logits[0].double()
    reference = torch.log_softmax(logits, dim=-1)[len(prompt) - 1:-1]  # the distribution of each output token
    tokenizer = Tokenizer(tiny_mixtral_dir)
    logprobs = choice["logprobs"]
    assert len(logprobs["token_logprobs"]) == len(output) == 5
    assert logprobs["tokens"] == [openai_token(tokenizer, t) for t in output]
    for position, (token, chosen, top) in enumerate(zip(output, logprobs["token_logprobs"], logprobs["top_logprobs"])):
        assert chosen == pytest.approx(reference[position, token].item(), abs=1e-4)
        values, ids = torch.topk(reference[position], 2)
        assert list(top) == [openai_token(tokenizer, i) for i in ids.tolist()]  # the chosen (best) first
        assert list(top.values()) == pytest.approx(values.tolist(), abs=1e-4)
        assert token == ids[0].item()  # greedy


def test_bad_lines_get_openai_errors_naming_the_problem(batch_result):
    _, _, lines = batch_result
    errors = {line["custom_id"]: line["response"]["body"]["error"] for line in lines[3:]}
    assert "outside the vocabulary" in errors["bad-range"]["message"]
    assert errors["bad-type"]["param"] == "max_tokens"
    assert errors["bad-url"]["code"] == "not_found"
    for error in errors.values():
        assert set(error) == {"message", "type", "param", "code"}


def test_console_script_runs(tiny_mixtral_dir, tmp_path):
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(source, [{"custom_id": "a", "method": "POST", "url": "/v1/completions",
                          "body": {"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0}}])
    command = shutil.which("raymoe") or sys.executable
    args = [command] if command.endswith("raymoe") else [command, "-m", "raymoe.cluster.cli"]
    done = subprocess.run(args + ["run-batch", "-i", str(source), "-o", str(target), "--model", tiny_mixtral_dir],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "1 ok, 0 failed" in done.stderr
    assert read_jsonl(target)[0]["response"]["status_code"] == 200
