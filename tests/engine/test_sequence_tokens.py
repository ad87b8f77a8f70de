"""``Sequence.tokens(start, stop)`` is ``token_ids()[start:stop]`` for every range (the engine's
inputs read it each step instead of copying every token of every sequence)."""

from __future__ import annotations

import pytest

from raymoe.engine.sampling_params import SamplingParams
from raymoe.engine.sequence import Sequence


@pytest.mark.parametrize("num_prompt, num_output", [(1, 0), (5, 0), (5, 3), (1, 7), (4, 4)])
def test_tokens_is_the_slice_of_token_ids(num_prompt, num_output):
    sequence = Sequence("r", list(range(100, 100 + num_prompt)), SamplingParams(), None, 0,
                        output_ids=list(range(200, 200 + num_output)))
    every = sequence.token_ids()
    for start in range(len(every) + 1):
        for stop in range(start, len(every) + 2):
            assert sequence.tokens(start, stop) == every[start:stop], (start, stop)
