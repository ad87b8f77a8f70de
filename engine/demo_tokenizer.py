"""A small byte-level BPE tokenizer built offline, for demo and test checkpoints.

Nothing can be downloaded, so demo checkpoints carry a tokenizer trained here on a short
built-in text. Byte-level BPE encodes any string; the vocabulary is 256 bytes, a few
special tokens, and merges up to ``vocab_size``.
"""

from __future__ import annotations

import json
import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>")
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_CORPUS = """
Mixture-of-experts models route every token to a few experts out of many. A router scores
the experts, picks the top k, and the chosen experts run their feed-forward networks on the
token. Expert parallelism places experts on different GPUs; tokens travel to the experts and
results travel back. The quick brown fox jumps over the lazy dog. Hello world! How are you
today? Please write a short poem about the sea, the sky and the mountains. One, two, three,
four, five, six, seven, eight, nine, ten. What is the capital of France? Paris is the
capital of France. Serving systems batch requests continuously and stream tokens back.
"""


def build_demo_tokenizer(vocab_size: int) -> Tokenizer:
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"a byte-level demo tokenizer needs vocab_size >= {256 + len(SPECIAL_TOKENS)}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    return tokenizer


def write_demo_tokenizer(model_dir: str, vocab_size: int) -> dict[str, int]:
    """Write tokenizer.json and tokenizer_config.json (with a ChatML template) into ``model_dir``.

    Returns the ids of the special tokens, for the model's config.json.
    """
    tokenizer = build_demo_tokenizer(vocab_size)
    os.makedirs(model_dir, exist_ok=True)
    tokenizer.save(os.path.join(model_dir, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<pad>",
        "chat_template": CHATML_TEMPLATE,
        "model_max_length": 4096,
    }
    with open(os.path.join(model_dir, "tokenizer_config.json"), "w", encoding="utf-8") as handle:
        json.dump(config, handle, indent=2)
    return {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
