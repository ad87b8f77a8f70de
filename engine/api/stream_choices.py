"""One streamed choice of a request: its outputs in, the ``choices[i]`` of each SSE chunk out.

Streamed requests generate exactly their choices (``best_of`` > ``n`` is refused with
``stream``), so sequence k is choice k, of prompt ``k // n``.
"""

from __future__ import annotations

from typing import Any, Callable

from raymoe.engine.api.chat import ChatStream
from raymoe.engine.api.choices import TextOffsets, completion_logprobs, prompt_positions
from raymoe.engine.api.completions import Endpoint, PreparedRequest, logprobs_body
from raymoe.engine.engine import RequestOutput
from raymoe.engine.prompt_logprobs import PromptLogprobs
from raymoe.engine.api.stream_text import TextStream
from raymoe.engine.tokenizer import Tokenizer


class StreamedChoice:
    def __init__(self, index: int, prepared: PreparedRequest, tokenizer: Tokenizer | None,
                 decode: Callable[[list[int]], str]):
        self.index = index
        self.prepared = prepared
        self.tokenizer = tokenizer
        self.chat = prepared.endpoint is Endpoint.CHAT
        self.text = TextStream(decode, prepared.params.stop, tokenizer.byte_fallback_ids if tokenizer else frozenset())
        self.chat_stream = ChatStream(prepared.chat) if self.chat else None
        self.prompt = prepared.prompts[index // prepared.n]
        self.sent_tokens = 0
        self.offsets = TextOffsets()  # where the next logprob's token starts in the choice's text
        self.sent_prompt_ids = False

    def echo(self, score: PromptLogprobs | None) -> dict[str, Any]:
        """The first chunk of an echoed completion: the prompt's text (and its logprobs); the
        last one as well when nothing is generated (max_tokens 0)."""
        prepared = self.prepared
        choice: dict[str, Any] = {"index": self.index, "text": prepared.echo_texts[self.index // prepared.n],
                                  "finish_reason": None if prepared.generates else "length", "logprobs": None}
        if prepared.want_logprobs and score is not None:
            choice["logprobs"] = completion_logprobs(prompt_positions(self.prompt, score, prepared.logprobs),
                                                     self.tokenizer, self.offsets)
        self._token_ids(choice, [])
        return choice

    def update(self, output: RequestOutput) -> dict[str, Any]:
        """The chunk choice for what ``output`` added since the last one."""
        piece = self.text.update(output.output_token_ids, output.finished, output.stop_text_index)
        choice: dict[str, Any] = {"index": self.index, "finish_reason": output.finish_reason}
        if self.chat:
            choice["delta"] = self.chat_stream.delta(piece, output.finished, choice)
        else:
            choice["text"] = piece
        choice["logprobs"] = None
        if self.prepared.want_logprobs:
            choice["logprobs"] = logprobs_body(output, self.tokenizer, self.chat, start=self.sent_tokens,
                                               offsets=self.offsets)
        self._token_ids(choice, output.output_token_ids[self.sent_tokens:])
        self.sent_tokens = len(output.output_token_ids)
        return choice

    def _token_ids(self, choice: dict[str, Any], new_tokens: list[int]) -> None:
        if self.prepared.return_token_ids:
            choice["token_ids"] = list(new_tokens)
            if not self.sent_prompt_ids:
                choice["prompt_token_ids"] = list(self.prompt)
                self.sent_prompt_ids = True
