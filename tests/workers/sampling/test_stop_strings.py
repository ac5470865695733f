"""Stop strings checked on the tail of a sample, not its whole text: a sample stops at the same
token as when every step decoded the whole sequence, with real tokenizers (the built-in byte
tokenizer, whose characters span up to 4 tokens, and a trained BPE whose decoder drops a
leading space), and a long sample decodes a bounded tail each step."""

from __future__ import annotations

import random
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from queue_tinker.builtin_models import load_tokenizer
from queue_tinker.types.requests.sampling import SamplingParams
from queue_tinker.workers.model.base_model import load_base_model
from queue_tinker.workers.sampling.decode_loop import GenerationRequest, generate
from queue_tinker.workers.sampling.step_outputs import (
    STOP_CONTEXT_TOKENS,
    STOP_TOKENS_PER_CHAR,
    stop_string_tail,
)

BASE = "queue-tinker/tiny-llama"
EOS = 257
# Spaces, ASCII, 2-, 3- and 4-byte UTF-8 characters.
ALPHABET = list("  abcde.,\né日本🙂")

Decode = Callable[[list[int]], str]


@pytest.fixture(scope="module")
def models_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="qt-stop-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def trained_bpe() -> PreTrainedTokenizerFast:
    """A BPE with SentencePiece's spaces ("▁"), whose decoder drops a text's leading space:
    the case where a tail decodes its first characters unlike the whole text."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    texts = ["".join(random.Random(i).choices(ALPHABET, k=200)) for i in range(50)]
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>"])
    tokenizer.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


def first_stop(tokens: list[int], strings: list[str], decode: Decode, tail: bool) -> int | None:
    """The step a sample of `tokens` stops at: each step's text is the whole sequence so far
    (as before), or its stop-string tail."""
    for step in range(1, len(tokens) + 1):
        sequence = tokens[:step]
        text = decode(stop_string_tail(sequence, strings) if tail else sequence)
        if any(s in text for s in strings):
            return step
    return None


@pytest.mark.parametrize("tokenizer", ["byte", "bpe"])
def test_the_tail_stops_where_the_whole_text_stops(tokenizer: str, models_dir: Path) -> None:
    decode_with = load_tokenizer(BASE, models_dir) if tokenizer == "byte" else trained_bpe()

    def decode(ids: list[int]) -> str:
        return str(decode_with.decode(ids))

    draws = random.Random(7)
    stopped = 0
    for case in range(300):
        text = "".join(draws.choices(ALPHABET, k=draws.randint(20, 120)))
        tokens = list(decode_with.encode(text, add_special_tokens=False))
        whole = decode(tokens)
        # Substrings of what the sample will say (they hit), with and without a leading space,
        # and one it never says.
        strings = []
        for _ in range(draws.randint(1, 3)):
            start = draws.randrange(len(whole))
            strings.append(whole[start : start + draws.randint(1, 8)])
        strings.append("zz")
        want = first_stop(tokens, strings, decode, tail=False)
        assert first_stop(tokens, strings, decode, tail=True) == want, (case, text, strings)
        stopped += want is not None
    assert stopped > 250  # the cases do stop, mostly before the end


def test_a_long_sample_decodes_a_bounded_tail_each_step(models_dir: Path) -> None:
    """Through the real decode loop on the tiny model: 300 tokens under a stop string it never
    says, every decode at most the tail's length; then the same sample with a stop string it
    says late ends on the token that completes it."""
    model = load_base_model(BASE, "cpu", models_dir).eval()
    tokenizer = load_tokenizer(BASE, models_dir)
    lengths: list[int] = []

    def decode(ids: list[int]) -> str:
        lengths.append(len(ids))
        return str(tokenizer.decode(ids))

    def sample(stop: list[str]) -> list[int]:
        params = SamplingParams(max_tokens=300, seed=3, temperature=1.0, stop=stop)
        request = GenerationRequest([256, *b"hello"], 1, params, 300, False, None)
        (response,) = generate(
            model, [request], device=torch.device("cpu"), eos_token_ids=[], decode=decode
        )
        return response.sequences[0].tokens

    never = "\x00never said\x00"
    free = sample([never])
    assert len(free) == 300
    assert max(lengths) == STOP_TOKENS_PER_CHAR * len(never) + STOP_CONTEXT_TOKENS
    text = str(tokenizer.decode(free))
    late = text[-40:-30]  # said near the end, maybe earlier too
    want = first_stop(free, [late], lambda ids: str(tokenizer.decode(ids)), tail=False)
    assert want is not None and want > 0
    assert sample([late]) == free[:want]
