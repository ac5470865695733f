"""A decode step reads the device once: its tokens, logprobs, stop flags and any top-k
logprobs come to the host in one copy (host_reads.to_host, counted here), on the left-padded
step and on slots, with greedy, tempered, top-k, top-p and top-k-logprob rows on two adapters
mixed; rows leaving read nothing more."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest
from test_sampler import CPU, EOS, PROMPTS, Setup, request, sampler_setup

from queue_tinker.workers.sampling.decode_loop import DecodeLoop
from queue_tinker.workers.sampling.host_reads import counting

STEPS = 8


@pytest.fixture(scope="module")
def setup() -> Iterator[Setup]:
    yield from sampler_setup()


def started_loop(setup: Setup, slots: bool, short: int = 40) -> DecodeLoop:
    """A loop with every kind of row admitted (its first step run): none stops on a token;
    the last request ends after `short` tokens."""
    loop = DecodeLoop(CPU, [EOS], setup.decode, max_rows=None, slots=slots)
    requests = [
        request(PROMPTS[0], None, n=2, max_tokens=40, seed=1, stop=[], temperature=0),
        request(PROMPTS[1], "a1", n=2, max_tokens=40, seed=2, stop=[], temperature=0.8),
        request(PROMPTS[2], "a2", max_tokens=40, seed=3, stop=[], top_k=20, top_p=0.9),
        replace(request(PROMPTS[3], "a1", max_tokens=short, seed=4, stop=[]), sample_topk=3),
    ]
    for key, req in enumerate(requests):
        loop.add(key, req)
    loop.step(setup.model)
    return loop


@pytest.mark.parametrize("slots", [False, True], ids=["padded", "slots"])
def test_a_decode_step_reads_the_device_once(setup: Setup, slots: bool) -> None:
    loop = started_loop(setup, slots)
    assert type(loop.running).__name__ == ("SlotRows" if slots else "Rows")
    for _ in range(STEPS):
        with counting() as reads:
            assert loop.step(setup.model) == []
        assert reads.count == 1
        # Nothing copied to the device: the drawing rows' uniforms are made there from their
        # streams and steps, and every row is chosen in one pass (no row index per kind).
        assert reads.copies == 0


def test_every_copy_to_the_device_goes_through_to_device() -> None:
    """No module of the sampler builds a device tensor from host values itself (a pageable
    copy that waits for the device on CUDA): each goes through host_reads.to_device."""
    import re
    from pathlib import Path

    folder = Path(DecodeLoop.__module__.replace(".", "/")).parent
    root = Path(__file__).resolve().parents[3]
    found = []
    for path in sorted((root / "workers" / folder.name).glob("*.py")):
        if path.name == "host_reads.py":
            continue
        text = path.read_text()
        for call in re.finditer(r"torch\.(?:tensor|as_tensor)\(([^()]|\([^()]*\))*\)", text):
            if "device" in call.group(0):
                found.append(f"{path.name}: {call.group(0)[:60]}")
    assert found == []


@pytest.mark.parametrize("slots", [False, True], ids=["padded", "slots"])
def test_rows_leave_without_another_read(setup: Setup, slots: bool) -> None:
    """A row leaving: on slots its slot is freed, on the padded step the columns no row uses
    are cut, found from the rows' lengths (the mask is not read)."""
    loop = started_loop(setup, slots=slots, short=3)
    assert type(loop.running).__name__ == ("SlotRows" if slots else "Rows")
    finished = []
    for _ in range(4):
        with counting() as reads:
            finished += loop.step(setup.model)
        assert reads.count == 1
    assert [key for key, _ in finished] == [3]


@pytest.mark.parametrize("slots", [False, True], ids=["padded", "slots"])
def test_rows_join_with_one_read_of_their_prefill(setup: Setup, slots: bool) -> None:
    """A request joining a running loop: its prefill's first tokens and the step's come to
    the host once each; placing its rows in slots reads nothing (their lengths are known)."""
    loop = started_loop(setup, slots=slots)
    loop.add(9, request(PROMPTS[1], "a2", n=2, max_tokens=5, seed=9, stop=[], temperature=0.7))
    with counting() as reads:
        loop.step(setup.model)
    assert reads.count == 2
