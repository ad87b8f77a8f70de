"""Clients people point at an OpenAI-compatible server, against a real raymoe server:
lm-evaluation-harness' `local-completions` (loglikelihood and rolling loglikelihood, with its
default token-id requests, one by one and in batches of 4) and LangChain's `OpenAI.batch`.

Offline: the tasks and their JSONL data are written here; lm-eval reads the checkpoint's
tokenizer.json. The reference for every loglikelihood is the in-process engine's scoring.
"""

from __future__ import annotations

import json
import math

import openai
import pytest
import torch

from raymoe.engine.engine import EngineConfig, LLMEngine
from server_process import served

MULTIPLE_CHOICE = [
    {"question": "What is the capital of France?", "choices": [" Paris", " Rome", " Berlin"], "answer": 0},
    {"question": "The quick brown fox jumps over the lazy", "choices": [" dog", " cat"], "answer": 0},
    {"question": "One, two, three,", "choices": [" four", " seven", " ten"], "answer": 0},
]
DOCUMENTS = [
    {"text": "Mixture-of-experts models route every token to a few experts out of many."},
    {"text": "Serving systems batch requests continuously and stream tokens back."},
]


@pytest.fixture(scope="module")
def server(tiny_mixtral_dir, tmp_path_factory):
    yield from served(tmp_path_factory.mktemp("clients"), tiny_mixtral_dir,
                      "routers: 1\nexpert_workers: 2\nserve:\n  served_model_name: tiny\n")


@pytest.fixture(scope="module")
def reference(tiny_mixtral_dir):
    return LLMEngine.from_pretrained(tiny_mixtral_dir, EngineConfig(dtype="float32"))


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_mixtral_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_mixtral_dir)


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    """Two lm-eval tasks over local JSONL files: a multiple_choice and a loglikelihood_rolling one."""
    folder = tmp_path_factory.mktemp("lm-eval-tasks")
    for name, rows in (("mc", MULTIPLE_CHOICE), ("docs", DOCUMENTS)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / "raymoe_mc.yaml").write_text(f"""task: raymoe_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / 'mc.jsonl'}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
""")
    (folder / "raymoe_rolling.yaml").write_text(f"""task: raymoe_rolling
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / 'docs.jsonl'}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: bits_per_byte
""")
    return folder


def continuation_logprob(reference, context: list[int], continuation: list[int]) -> float:
    """Sum of the continuation's token logprobs given the context, from the in-process engine."""
    tokens = context + continuation
    logprobs = torch.log_softmax(reference.score([tokens])[0].double(), dim=-1)
    return sum(logprobs[i - 1, tokens[i]].item() for i in range(len(context), len(tokens)))


@pytest.mark.parametrize("batch_size", [1, 4])
def test_lm_eval_local_completions_matches_the_engine(server, reference, hf_tokenizer, tasks, tiny_mixtral_dir,
                                                      batch_size, monkeypatch):
    import lm_eval
    from lm_eval.tasks import TaskManager

    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    model_args = (f"model=tiny,base_url={server.url}/v1/completions,tokenizer={tiny_mixtral_dir},"
                  f"tokenizer_backend=huggingface,max_length=200,max_retries=1")
    results = lm_eval.simple_evaluate(model="local-completions", model_args=model_args,
                                      tasks=["raymoe_mc", "raymoe_rolling"], batch_size=batch_size,
                                      task_manager=TaskManager(include_path=str(tasks)), log_samples=True)
    mc = results["samples"]["raymoe_mc"]
    assert len(mc) == len(MULTIPLE_CHOICE)
    for sample in mc:
        doc = sample["doc"]
        context = hf_tokenizer.encode(doc["question"], add_special_tokens=False)
        expected = [continuation_logprob(reference, context,
                                         hf_tokenizer.encode(doc["question"] + c, add_special_tokens=False)[len(context):])
                    for c in doc["choices"]]
        got = [response[0][0] for response in sample["resps"]]
        assert got == pytest.approx(expected, abs=1e-3)
        assert sample["acc"] == float(max(range(len(expected)), key=expected.__getitem__) == doc["answer"])
    rolling = results["samples"]["raymoe_rolling"]
    assert len(rolling) == len(DOCUMENTS)
    eot = hf_tokenizer.eos_token_id
    for sample in rolling:
        text = sample["doc"]["text"]
        expected = continuation_logprob(reference, [eot], hf_tokenizer.encode(text, add_special_tokens=False))
        loglikelihood = sample["resps"][0][0]
        assert (loglikelihood[0] if isinstance(loglikelihood, (list, tuple)) else loglikelihood) == \
            pytest.approx(expected, abs=1e-3)
    perplexity = results["results"]["raymoe_rolling"]["word_perplexity,none"]
    assert math.isfinite(perplexity) and perplexity > 1


def test_langchain_batch_answers_each_prompt(server):
    from langchain_openai import OpenAI

    prompts = ["Hello world", "What is the capital of France?", "One, two, three", "The quick brown fox",
               "Serving systems"]
    llm = OpenAI(model="tiny", base_url=f"{server.url}/v1", api_key="unused", temperature=0, max_tokens=6,
                 max_retries=0)
    assert llm.batch_size >= len(prompts)  # its default: every prompt goes in one request
    answers = llm.batch(prompts)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    alone = [client.completions.create(model="tiny", prompt=p, temperature=0, max_tokens=6).choices[0].text
             for p in prompts]
    assert answers == alone
