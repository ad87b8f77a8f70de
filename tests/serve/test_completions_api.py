"""/v1/completions as real clients use it, through the official `openai` client on a real
server: echo and prompt logprobs, batched prompts, n and best_of with seeds, the penalty and
bias fields, refusals that name the field, logprob text and bytes, /tokenize and /detokenize.

References: the in-process engine (same ids, same SamplingParams), transformers' forward for
the prompt's logprobs, transformers' byte alphabet for token bytes.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest
import torch

from openai_tokens import openai_token, token_bytes
from raymoe.engine.engine import EngineConfig, LLMEngine
from raymoe.engine.sampling_params import SamplingParams
from raymoe.engine.tokenizer import Tokenizer
from server_process import served

PROMPT_IDS = [10, 11, 12, 13]
GREEDY = dict(model="tiny", temperature=0, max_tokens=6)


@pytest.fixture(scope="module")
def server(tiny_mixtral_dir, tmp_path_factory):
    yield from served(tmp_path_factory.mktemp("completions-api"), tiny_mixtral_dir,
                      "routers: 2\nexpert_workers: 2\nserve:\n  served_model_name: tiny\n")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(tiny_mixtral_dir):
    return LLMEngine.from_pretrained(tiny_mixtral_dir, EngineConfig(dtype="float32"))


@pytest.fixture(scope="module")
def tokenizer(tiny_mixtral_dir):
    return Tokenizer(tiny_mixtral_dir)


def post(server, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(server.url + path, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def ids_of(choice) -> list[int]:
    return choice.model_extra["token_ids"]


# ---- echo and prompt logprobs -------------------------------------------------------------
def test_echo_logprobs_equal_the_engine_and_transformers(client, reference, tiny_mixtral_dir, tokenizer):
    """lm-eval's loglikelihood request: echo, max_tokens 0, logprobs 2, the prompt as token ids."""
    from transformers import AutoModelForCausalLM

    prompt = tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    response = client.completions.create(model="tiny", prompt=[prompt], echo=True, max_tokens=0, logprobs=2,
                                         temperature=0)
    (choice,) = response.choices
    logprobs = choice.logprobs
    assert choice.text == tokenizer.decode(prompt, skip_special_tokens=False) and choice.finish_reason == "length"
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None  # nothing predicts token 0
    assert logprobs.tokens == [openai_token(tokenizer, t) for t in prompt]
    engine = torch.log_softmax(reference.score([prompt])[0].double(), dim=-1)  # [L, V]
    model = AutoModelForCausalLM.from_pretrained(tiny_mixtral_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        hf = torch.log_softmax(model(input_ids=torch.tensor([prompt])).logits[0].double(), dim=-1)
    for position in range(1, len(prompt)):
        token, ours = prompt[position], logprobs.token_logprobs[position]
        assert ours == pytest.approx(engine[position - 1, token].item(), abs=1e-5)
        assert ours == pytest.approx(hf[position - 1, token].item(), abs=1e-4)
        values, ids = torch.topk(hf[position - 1], 2)
        expected = {openai_token(tokenizer, token): hf[position - 1, token].item()}
        for alternative, value in zip(ids.tolist(), values.tolist()):
            expected.setdefault(openai_token(tokenizer, alternative), value)
        top = logprobs.top_logprobs[position]
        assert list(top) == list(expected)  # its own token, then the 2 best
        assert list(top.values()) == pytest.approx(list(expected.values()), abs=1e-4)
    assert response.usage.prompt_tokens == len(prompt) and response.usage.completion_tokens == 0


def test_echo_with_generation_is_the_prompt_then_the_completion(client, reference):
    plain = client.completions.create(prompt=PROMPT_IDS, logprobs=1, extra_body={"ignore_eos": True,
                                                                               "return_token_ids": True}, **GREEDY)
    echoed = client.completions.create(prompt=PROMPT_IDS, logprobs=1, echo=True,
                                       extra_body={"ignore_eos": True, "return_token_ids": True}, **GREEDY)
    a, b = plain.choices[0], echoed.choices[0]
    assert ids_of(a) == ids_of(b) and len(ids_of(a)) == GREEDY["max_tokens"]
    assert b.text.endswith(a.text) and len(b.text) > len(a.text)
    assert len(b.logprobs.tokens) == len(PROMPT_IDS) + len(ids_of(a))
    assert b.logprobs.token_logprobs[len(PROMPT_IDS):] == pytest.approx(a.logprobs.token_logprobs, abs=1e-6)
    scored = torch.log_softmax(reference.score([PROMPT_IDS])[0].double(), dim=-1)
    assert b.logprobs.token_logprobs[1:len(PROMPT_IDS)] == pytest.approx(
        [scored[i - 1, PROMPT_IDS[i]].item() for i in range(1, len(PROMPT_IDS))], abs=1e-5)
    offsets = b.logprobs.text_offset
    assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] < len(b.text)


def test_prompt_logprobs_as_vllm_returns_them(client, reference, tokenizer):
    response = client.completions.create(prompt=PROMPT_IDS, extra_body={"prompt_logprobs": 3}, **GREEDY)
    body = response.choices[0].model_extra["prompt_logprobs"]
    assert len(body) == len(PROMPT_IDS) and body[0] is None
    scored = torch.log_softmax(reference.score([PROMPT_IDS])[0].double(), dim=-1)
    for position in range(1, len(PROMPT_IDS)):
        row, token = scored[position - 1], PROMPT_IDS[position]
        entry = body[position]
        values, ids = torch.topk(row, 3)
        assert set(entry) == {str(token), *map(str, ids.tolist())}
        assert entry[str(token)]["logprob"] == pytest.approx(row[token].item(), abs=1e-5)
        assert entry[str(token)]["rank"] == int((row > row[token]).sum()) + 1
        assert entry[str(token)]["decoded_token"] == openai_token(tokenizer, token)
        for rank, alternative in enumerate(ids.tolist(), 1):
            assert entry[str(alternative)]["rank"] == rank or alternative == token


def test_echo_streams_the_prompt_first(client):
    whole = client.completions.create(prompt=PROMPT_IDS, echo=True, logprobs=1, extra_body={"ignore_eos": True},
                                      **GREEDY).choices[0]
    chunks = list(client.completions.create(prompt=PROMPT_IDS, echo=True, logprobs=1, stream=True,
                                            extra_body={"ignore_eos": True}, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    streamed = [lp for c in chunks for lp in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(whole.logprobs.token_logprobs, abs=1e-6)
    assert [o for c in chunks for o in c.choices[0].logprobs.text_offset] == whole.logprobs.text_offset


# ---- batches, n, best_of, seeds -----------------------------------------------------------
@pytest.mark.parametrize("batch", [["Hello world", "What is the capital of France?", "One, two"],
                                   [[5, 6, 7], [40, 41], PROMPT_IDS]])
def test_a_batch_of_prompts_answers_each_in_order(client, batch):
    response = client.completions.create(prompt=batch, extra_body={"ignore_eos": True}, **GREEDY)
    alone = [client.completions.create(prompt=p, extra_body={"ignore_eos": True}, **GREEDY) for p in batch]
    assert [c.index for c in response.choices] == list(range(len(batch)))
    assert [c.text for c in response.choices] == [a.choices[0].text for a in alone]
    assert response.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert response.usage.completion_tokens == len(batch) * GREEDY["max_tokens"]


def test_n_with_a_seed_differs_per_choice_and_repeats(client):
    kwargs = dict(model="tiny", prompt=[PROMPT_IDS, [7, 8, 9]], n=3, temperature=1.0, max_tokens=8, seed=11,
                  extra_body={"ignore_eos": True, "return_token_ids": True})
    first, again = client.completions.create(**kwargs), client.completions.create(**kwargs)
    assert [c.index for c in first.choices] == list(range(6))  # prompt_index * n + i
    assert [ids_of(c) for c in first.choices] == [ids_of(c) for c in again.choices]
    assert len({tuple(ids_of(c)) for c in first.choices[:3]}) == 3  # distinct seeds, distinct samples
    single = client.completions.create(**dict(kwargs, prompt=[7, 8, 9]))  # a prompt samples the same in a batch
    assert [ids_of(c) for c in single.choices] == [ids_of(c) for c in first.choices[3:]]
    assert all(c.model_extra["prompt_token_ids"] == [7, 8, 9] for c in first.choices[3:])


def test_best_of_returns_the_n_with_the_highest_cumulative_logprob(client):
    kwargs = dict(model="tiny", prompt=PROMPT_IDS, temperature=1.0, max_tokens=6, seed=5, logprobs=0,
                  extra_body={"ignore_eos": True, "return_token_ids": True})
    every = client.completions.create(n=4, **kwargs).choices  # the same four sequences (same seeds)
    best = client.completions.create(n=2, best_of=4, **kwargs).choices
    ranked = sorted(every, key=lambda c: -sum(c.logprobs.token_logprobs))
    assert [ids_of(c) for c in best] == [ids_of(c) for c in ranked[:2]]
    assert [c.index for c in best] == [0, 1]
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(n=1, best_of=2, stream=True, **kwargs)
    assert refused.value.body["param"] == "best_of"


def test_n_streams_every_choice(client):
    kwargs = dict(model="tiny", prompt=PROMPT_IDS, n=2, temperature=1.0, max_tokens=6, seed=3,
                  extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs)
    texts = ["", ""]
    for chunk in client.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in whole.choices]


# ---- sampling fields ---------------------------------------------------------------------
@pytest.mark.parametrize("field, value", [("presence_penalty", 2.0), ("frequency_penalty", 2.0),
                                          ("repetition_penalty", 2.0), ("logit_bias", {"7": 100.0})])
def test_sampling_fields_reach_the_sampler(client, reference, field, value):
    params = dict(max_tokens=12, temperature=0.0, ignore_eos=True)
    engine_value = tuple((int(k), v) for k, v in value.items()) if isinstance(value, dict) else value
    want = reference.generate([PROMPT_IDS], SamplingParams(**params, **{field: engine_value}))[0].output_token_ids
    plain = reference.generate([PROMPT_IDS], SamplingParams(**params))[0].output_token_ids
    assert want != plain  # the field changes this output: ignoring it would show
    extra = {"ignore_eos": True, "return_token_ids": True}
    if field == "repetition_penalty":  # vLLM's field: not among the openai client's arguments
        kwargs = {"extra_body": dict(extra, repetition_penalty=value)}
    else:
        kwargs = {field: value, "extra_body": extra}
    response = client.completions.create(model="tiny", prompt=PROMPT_IDS, max_tokens=12, temperature=0, **kwargs)
    assert ids_of(response.choices[0]) == want


def test_min_tokens_holds_back_a_stop_token(client):
    first = ids_of(client.completions.create(prompt=PROMPT_IDS, extra_body={"return_token_ids": True},
                                             **GREEDY).choices[0])[0]
    stopped = client.completions.create(prompt=PROMPT_IDS, extra_body={"return_token_ids": True,
                                                                       "stop_token_ids": [first]}, **GREEDY)
    assert ids_of(stopped.choices[0]) == [first] and stopped.choices[0].finish_reason == "stop"
    held = client.completions.create(prompt=PROMPT_IDS, extra_body={"return_token_ids": True, "min_tokens": 4,
                                                                    "stop_token_ids": [first]}, **GREEDY)
    tokens = ids_of(held.choices[0])
    assert len(tokens) >= 4 and first not in tokens[:4]


# ---- refusals ----------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, param", [
    (dict(suffix=" the end"), "suffix"),
    (dict(extra_body={"guided_regex": "a+"}), "guided_regex"),
    (dict(extra_body={"stream_options": {"include_usage": True, "x": 1}}), "stream_options.x"),
    (dict(max_tokens=0), "max_tokens"),  # 0 only with echo
    (dict(n=3, best_of=2), "best_of"),
    (dict(logit_bias={"999999": 5}), "logit_bias"),
    (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(extra_body={"prompt_logprobs": 2}, stream=True), "prompt_logprobs"),
])
def test_unsupported_or_invalid_fields_are_refused_by_name(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="tiny", prompt="Hello", **kwargs)
    assert refused.value.status_code == 400 and refused.value.body["param"] == param
    assert param.split(".")[0] in refused.value.body["message"]


def test_harmless_default_fields_are_accepted(client):
    response = client.completions.create(model="tiny", prompt="Hello", max_tokens=2, user="someone", best_of=1)
    assert len(response.choices) == 1


# ---- logprob text and bytes --------------------------------------------------------------
def test_logprob_tokens_are_text_and_bytes_are_the_tokens_own(client, tokenizer):
    prompt = tokenizer.encode("Paris is the capital of France. é€")
    response = client.completions.create(model="tiny", prompt=prompt, echo=True, max_tokens=0, logprobs=0)
    tokens = response.choices[0].logprobs.tokens
    assert tokens == [openai_token(tokenizer, t) for t in prompt]
    assert not any(t.startswith("Ġ") for t in tokens) and " the" in tokens  # the vocabulary has "Ġthe"
    assert any(t.startswith("bytes:\\x") for t in tokens)  # é and € are split into byte tokens
    assert b"".join(token_bytes(tokenizer, t) for t in prompt).decode() == response.choices[0].text
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                          temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body={"ignore_eos": True, "return_token_ids": True})
    for entry, token in zip(chat.choices[0].logprobs.content, chat.choices[0].model_extra["token_ids"]):
        assert bytes(entry.bytes) == token_bytes(tokenizer, token)
        assert entry.token == openai_token(tokenizer, token)


# ---- /tokenize and /detokenize -----------------------------------------------------------
def test_tokenize_and_detokenize_as_vllm_serves_them(server, tokenizer):
    text = "What is the capital of France?"
    code, body = post(server, "/tokenize", {"model": "tiny", "prompt": text, "return_token_strs": True})
    assert code == 200 and body["tokens"] == tokenizer.encode(text) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 256 and body["token_strs"] == [tokenizer.id_to_token(t) for t in body["tokens"]]
    messages = [{"role": "user", "content": text}]
    code, chat = post(server, "/tokenize", {"model": "tiny", "messages": messages})
    assert code == 200 and chat["tokens"] == tokenizer.encode(tokenizer.apply_chat_template(messages),
                                                              add_special_tokens=False)
    assert chat["token_strs"] is None
    code, back = post(server, "/detokenize", {"model": "tiny", "tokens": body["tokens"]})
    assert (code, back) == (200, {"prompt": text})
    for path, bad, param in [("/tokenize", {"prompt": text, "truncate": 3}, "truncate"),
                             ("/tokenize", {"model": "tiny"}, "prompt"),
                             ("/detokenize", {"tokens": [10**9]}, "tokens")]:
        code, error = post(server, path, bad)
        assert code == 400 and error["error"]["param"] == param, error


# ---- run-batch answers as the server does ------------------------------------------------
def test_run_batch_serves_echo_batches_and_n_as_the_server_does(client, reference, tokenizer):
    from raymoe.cluster.run_batch_cli import InProcessBatchEngine
    from raymoe.engine.api.completions import ModelLimits
    from raymoe.engine.api.run_batch import run_batch

    bodies = [{"model": "tiny", "prompt": [PROMPT_IDS, [7, 8, 9]], "echo": True, "max_tokens": 0, "logprobs": 1},
              {"model": "tiny", "prompt": PROMPT_IDS, "n": 2, "seed": 3, "temperature": 1.0, "max_tokens": 5,
               "ignore_eos": True, "logprobs": 0}]
    items = [{"custom_id": str(i), "method": "POST", "url": "/v1/completions", "body": b} for i, b in enumerate(bodies)]
    lines = run_batch(items, InProcessBatchEngine(reference), tokenizer,
                      ModelLimits("tiny", reference.config.vocab_size, reference.max_model_len), show_progress=False)
    for line, body in zip(lines, bodies):
        assert line["response"]["status_code"] == 200, line
        served = client.completions.create(**{k: v for k, v in body.items() if k != "ignore_eos"},
                                           extra_body={"ignore_eos": True} if "ignore_eos" in body else None)
        ours = line["response"]["body"]["choices"]
        assert [c["text"] for c in ours] == [c.text for c in served.choices]
        for mine, theirs in zip(ours, served.choices):
            assert mine["logprobs"]["tokens"] == theirs.logprobs.tokens
            assert mine["logprobs"]["token_logprobs"] == pytest.approx(theirs.logprobs.token_logprobs, abs=1e-4)
