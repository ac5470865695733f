"""What a decode step's chosen tokens do to its rows (the loop's output processor): each row's
token, logprob and any top-k candidates recorded on its request, its stop checks (a stop token,
a stop string found in the newest text only, max_tokens), and the rows and requests that end.
The tokens, logprobs, stop flags and candidates come to the host in one copy, the step's only
wait for the device."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from queue_tinker.workers.sampling.decode_rows import LiveRequest, Rows
from queue_tinker.workers.sampling.host_reads import to_host
from queue_tinker.workers.sampling.token_choice import Choices, top_logprob_rows

# A stop string found now ends in the newest token's text (an earlier end would have stopped
# the row then), so it begins at most this many tokens back per character: a character is at
# most 4 byte-level tokens. STOP_CONTEXT_TOKENS more keep the tail's first characters (a cut
# UTF-8 sequence, a leading space a decoder drops) away from the stop string.
STOP_TOKENS_PER_CHAR = 4
STOP_CONTEXT_TOKENS = 4


def record_step(
    rows: Rows, choices: Choices, wanted: list[int], decode: Callable[[list[int]], str]
) -> tuple[list[int], list[LiveRequest]]:
    """Record every row's chosen token (`wanted`: each row's top-k candidates asked for) and
    end the rows it ends; the rows that go on, and the requests whose last row ended."""
    tokens, candidates = choices.tokens, choices.candidates
    rows.tokens = tokens
    rows.steps = rows.steps + 1
    stop = (tokens[:, None] == rows.stop_ids).any(dim=-1)
    # One copy for all of it; float64 holds every token id and float32 logprob exactly.
    columns = [tokens.double(), choices.logprobs.double(), stop.double()]
    if candidates is not None:
        columns += [*candidates[0].double().T, *candidates[1].double().T]
    host = to_host(torch.stack(columns))
    token_list, logprob_list, stop_list = host[:3]
    topk: list[list[tuple[int, float]] | None] = [None] * rows.size
    if candidates is not None:
        k = candidates[0].shape[1]
        values = [list(row) for row in zip(*host[3 : 3 + k], strict=True)]
        ids = [[int(i) for i in row] for row in zip(*host[3 + k :], strict=True)]
        topk = top_logprob_rows(wanted, values, ids)
    keep: list[int] = []
    ended: list[LiveRequest] = []
    for i, (request, sample) in enumerate(zip(rows.requests, rows.samples, strict=True)):
        sequence = request.tokens[sample]
        sequence.append(int(token_list[i]))
        request.logprobs[sample].append(logprob_list[i])
        if (best := topk[i]) is not None:
            request.topk[sample].append(best)
        # Decode even a row at its length: "stop" wins when both end it on one token.
        stopped = bool(stop_list[i]) or hits_stop_string(request, sequence, decode)
        if stopped or len(sequence) >= request.spec.max_tokens:
            request.reasons[sample] = "stop" if stopped else "length"
            request.live -= 1
            if request.live == 0:
                ended.append(request)
        else:
            keep.append(i)
    return keep, ended


def hits_stop_string(
    request: LiveRequest, sequence: list[int], decode: Callable[[list[int]], str]
) -> bool:
    """Whether the sample's newest token completes one of its request's stop strings."""
    strings = request.spec.params.stop_strings
    if not strings:
        return False
    decoded = decode(stop_string_tail(sequence, strings))
    return any(s in decoded for s in strings)


def stop_string_tail(sequence: list[int], strings: Sequence[str]) -> list[int]:
    """The end of `sequence` that can hold a stop string completed by its newest token:
    decoding it each step is linear in a sample's length, where decoding the whole sequence
    each step was quadratic."""
    longest = max(len(s) for s in strings)
    return sequence[-(STOP_TOKENS_PER_CHAR * longest + STOP_CONTEXT_TOKENS) :]
