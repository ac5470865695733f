"""The decode step on fixed slots (slot_decode.py, kv_slots.py, adapter_slots.py) against the
left-padded loop and plain PEFT: same tokens for the same seeds, logits and logprobs to float32
rounding, on the CPU where the step runs eagerly (its CUDA graphs: tests/gpu)."""

from __future__ import annotations

import copy
import random
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from test_sampler import (
    CPU,
    EOS,
    PROMPTS,
    Setup,
    assert_close,
    forward_logits,
    mixed_requests,
    request,
    sampler_setup,
)

from queue_tinker.types.requests.sampling import SampleResponse
from queue_tinker.workers.model.lora.row_blocks import lora_layers_of
from queue_tinker.workers.sampling import decode_loop as sampler
from queue_tinker.workers.sampling.adapter_slots import (
    BASE_SLOT,
    AdapterSlots,
    lora_groups,
    slots_support,
    slotted_lora,
)
from queue_tinker.workers.sampling.cache_budget import slot_cache_tokens
from queue_tinker.workers.sampling.kv_pages import KvPages
from queue_tinker.workers.sampling.kv_slots import KvSlots
from queue_tinker.workers.sampling.slot_decode import (
    SlotDecoder,
    SlotRows,
    StepKind,
    bucket,
    column_bucket,
    decode_step_of,
    graph_rows,
    slots_fit,
)

SLOTS_VS_PADDED = (1e-5, 1e-5)  # rtol, atol: float32, other padding changes rounding only


@pytest.fixture(scope="module")
def setup() -> Iterator[Setup]:
    yield from sampler_setup()


# The slot step's two layer codes: the family's fused step (tiny-llama has one) and
# transformers' layers on the slots.
LAYERS = ("fused", "transformers")


def loop_of(setup: Setup, slots: bool, layers: str = "fused", **options: Any) -> sampler.DecodeLoop:
    return sampler.DecodeLoop(
        CPU,
        [EOS],
        setup.decode,
        **{"max_rows": None, **options},
        slots=slots,
        fused=layers == "fused",
    )


def run_loop(
    setup: Setup, slots: bool, arrivals: dict[int, list[Any]], **options: Any
) -> tuple[dict[Any, SampleResponse], sampler.DecodeLoop, set[str]]:
    """Requests added at the steps `arrivals` names (step -> [(key, request)]), the loop
    stepped until done; the responses, the loop, and the kinds of rows it ran."""
    loop = loop_of(setup, slots, **options)
    done: dict[Any, SampleResponse] = {}
    kinds: set[str] = set()
    step = 0
    while loop.busy or step <= max(arrivals):
        for key, req in arrivals.get(step, []):
            loop.add(key, req)
        done.update(loop.step(setup.model))
        if loop.running is not None:
            kinds.add(type(loop.running).__name__)
        step += 1
    return done, loop, kinds


def assert_equal_samples(got: dict[Any, SampleResponse], want: dict[Any, SampleResponse]) -> None:
    assert got.keys() == want.keys()
    for key, response in want.items():
        for x, y in zip(got[key].sequences, response.sequences, strict=True):
            assert (x.tokens, x.stop_reason) == (y.tokens, y.stop_reason), key
            assert_close(x.logprobs, torch.tensor(y.logprobs), SLOTS_VS_PADDED)
        assert got[key].prompt_cache_hit_tokens == response.prompt_cache_hit_tokens


# --- the loop on slots against the left-padded loop -----------------------------------------
@pytest.mark.parametrize("layers", LAYERS)
def test_slots_sample_what_the_padded_loop_samples(setup: Setup, layers: str) -> None:
    """Mixed adapters, settings and lengths, rows waiting for room (max_rows) and joining in
    parts as others leave: the same tokens for the same seeds, logprobs to rounding."""
    arrivals = {0: list(enumerate(mixed_requests()))}
    options: dict[str, Any] = {"max_rows": 4, "prefill_tokens": 20}
    want, _, padded = run_loop(setup, False, arrivals, **options)
    got, loop, slotted = run_loop(setup, True, arrivals, layers=layers, **options)
    assert padded == {"Rows"} and slotted == {"SlotRows"}
    assert_equal_samples(got, want)
    assert loop.slots is not None and loop.slots.slots.slots == 4  # a bucket of 4 rows


def test_rows_joining_and_leaving_mid_loop_on_slots(setup: Setup) -> None:
    """Requests join a running loop over several steps (one on a prompt kept from before: a
    prefix-cache hit), rows leave at different steps, one is cancelled: the slots give what
    the padded loop gives."""
    first = request(PROMPTS[1], "a1", n=3, max_tokens=20, seed=11, stop=[], temperature=0.9)
    arrivals = {
        0: [("first", first), ("short", request(PROMPTS[2], "sharp", max_tokens=3, seed=3))],
        3: [("a2", request(PROMPTS[0], "a2", n=2, max_tokens=12, seed=12, stop=[], top_p=0.9))],
        5: [("base", request(PROMPTS[3], None, max_tokens=8, temperature=0, stop=[]))],
        6: [("long", request(PROMPTS[2], "a1", n=2, max_tokens=70, seed=13, stop=[]))],
        8: [("again", request(PROMPTS[1], "a1", max_tokens=9, seed=14, stop=[], top_k=5))],
    }
    want, _, _ = run_loop(setup, False, arrivals)
    got, _, kinds = run_loop(setup, True, arrivals)
    assert kinds == {"SlotRows"}
    assert got["again"].prompt_cache_hit_tokens == len(PROMPTS[1])  # joined from the cache
    assert_equal_samples(got, want)


def test_a_cancelled_request_gives_up_its_slots(setup: Setup) -> None:
    keep = request(PROMPTS[0], "a2", n=2, max_tokens=10, seed=5, stop=[])
    loop = loop_of(setup, True)
    loop.add("gone", request(PROMPTS[1], "a1", n=3, max_tokens=10, seed=6, stop=[]))
    loop.add("kept", keep)
    loop.step(setup.model)
    assert isinstance(loop.running, SlotRows) and loop.rows == 5
    loop.cancel({"gone"})
    assert loop.rows == 2
    done: dict[Any, SampleResponse] = {}
    while loop.busy:
        done.update(loop.step(setup.model))
    want, _, _ = run_loop(setup, False, {0: [("kept", keep)]})
    assert_equal_samples(done, want)


@pytest.mark.parametrize(("layers", "store"), [("transformers", KvSlots), ("fused", KvPages)])
def test_rows_leaving_move_only_the_last_rows_into_their_slots(
    setup: Setup, monkeypatch: pytest.MonkeyPatch, layers: str, store: Any
) -> None:
    """Rows 1 and 2 of 6 leave: rows 4 and 5 move into slots 1 and 2 (one copy each, of their
    columns or of their pages' row of the table), rows 0 and 3 stay where they are, and every
    row keeps its settings and state."""
    moves: list[tuple[list[int], list[int]]] = []
    original = store.move

    def record(self: Any, sources: list[int], targets: list[int]) -> None:
        moves.append((list(sources), list(targets)))
        original(self, sources, targets)

    monkeypatch.setattr(store, "move", record)
    loop = loop_of(setup, True, layers)
    for seed in range(6):
        loop.add(seed, request(PROMPTS[seed % 4], "a1", max_tokens=30, seed=seed, stop=[]))
    loop.step(setup.model)
    rows = loop.running
    assert isinstance(rows, SlotRows)
    before = [
        (r.key, rows.next_pos[i].item(), rows.tokens[i].item()) for i, r in enumerate(rows.requests)
    ]
    rows.select([0, 3, 4, 5])
    assert moves[-1] == ([4, 5], [1, 2])
    after = [
        (r.key, rows.next_pos[i].item(), rows.tokens[i].item()) for i, r in enumerate(rows.requests)
    ]
    assert after == [before[0], before[4], before[5], before[3]]


@pytest.mark.parametrize("layers", LAYERS)
def test_the_slot_step_s_logits_equal_a_plain_forward(setup: Setup, layers: str) -> None:
    """Each row's logits at a decode step on slots equal those of its whole sequence run
    through the model alone with its adapter (no cache)."""
    loop = loop_of(setup, True, layers)
    adapters = ["a1", None, "a2", "sharp", "a1"]
    for index, adapter in enumerate(adapters):
        loop.add(index, request(PROMPTS[index % 4], adapter, max_tokens=8, temperature=0, stop=[]))
    for _ in range(4):
        loop.step(setup.model)
    rows = loop.running
    assert isinstance(rows, SlotRows) and loop.slots is not None
    logits = loop.slots.decode(setup.model, rows, lora_layers_of(setup.model), None)
    for i, (live, sample) in enumerate(zip(rows.requests, rows.samples, strict=True)):
        sequence = live.spec.prompt + live.tokens[sample]
        want = forward_logits(setup.model, live.spec.adapter, sequence)[-1]
        torch.testing.assert_close(logits[i], want, rtol=1e-5, atol=1e-5)


def test_the_kv_budget_counts_every_slot_as_wide_as_the_widest(setup: Setup) -> None:
    """On slots every row holds the columns of the widest row's end: a budget of two such
    rows runs the third request after the first two leave; samples are unchanged."""
    requests = [request(PROMPTS[1], "a1", max_tokens=20, seed=s, stop=[]) for s in range(3)]
    width = len(PROMPTS[1]) + 20
    assert slot_cache_tokens([(len(PROMPTS[1]), 20)] * 2) == 2 * width
    arrivals = {0: list(enumerate(requests))}
    want, _, _ = run_loop(setup, False, arrivals)
    loop = loop_of(setup, True, max_cache_tokens=2 * width)
    for key, req in arrivals[0]:
        loop.add(key, req)
    done: dict[Any, SampleResponse] = {}
    most = 0
    while loop.busy:
        done.update(loop.step(setup.model))
        most = max(most, loop.rows)
    assert most == 2
    assert_equal_samples(done, want)


# --- the LoRA slots ---------------------------------------------------------------------------
def test_slotted_lora_gives_each_row_its_own_adapter(setup: Setup) -> None:
    """Rows on three adapters of two ranks and the base model in one forward under the LoRA
    slots: each row's logits equal a forward on its adapter alone."""
    layers = lora_layers_of(setup.model)
    assert slots_support(layers)
    names = ["a1", None, "a2", "sharp", "a1"]
    adapters = [name for name in names if name is not None]
    rank = AdapterSlots.widest_rank(layers, adapters)  # type: ignore[arg-type]
    slots = AdapterSlots(lora_groups(setup.model, layers), 4, rank, torch.float32)  # type: ignore[arg-type]
    row_slot = torch.tensor(slots.slots_of(names))
    assert row_slot[1] == BASE_SLOT and row_slot[0] == row_slot[4]
    ids = torch.tensor([PROMPTS[1][:5]] * len(names))
    with torch.inference_mode(), slotted_lora(slots, row_slot):
        logits = setup.model(input_ids=ids, use_cache=False).logits
    for row, name in enumerate(names):
        want = forward_logits(setup.model, name, PROMPTS[1][:5])
        torch.testing.assert_close(logits[row], want, rtol=1e-5, atol=1e-5)


def test_a_slot_is_refilled_when_its_adapter_is_loaded_again(setup: Setup) -> None:
    """A name whose weights were replaced (a checkpoint loaded again) gets the new weights;
    a newcomer takes the slot of an adapter no row names."""
    model = copy.deepcopy(setup.model)
    layers = lora_layers_of(model)
    slots = AdapterSlots(lora_groups(model, layers), 2, 8, torch.float32)  # type: ignore[arg-type]
    assert slots.slots_of(["a1", "a2"]) == [0, 1]
    first = layers[0]
    fresh = torch.nn.Parameter(torch.randn_like(first.lora_A["a1"].weight))
    first.lora_A["a1"].weight = fresh
    assert slots.slots_of(["a1"]) == [0]
    rank = first.r["a1"]
    torch.testing.assert_close(slots.views[0][0][0, :rank], fresh.detach())
    assert slots.slots_of(["sharp", "a1"]) == [1, 0]  # a2 is not named: its slot is taken
    assert slots.names == ["a1", "sharp"]
    assert not slots.fits(["a1", "a2", "sharp"], layers)  # type: ignore[arg-type]


def test_an_adapter_the_model_lacks_is_refused_not_sampled_as_the_base(setup: Setup) -> None:
    """A row naming an adapter no LoRA layer holds (a model id where the PEFT name belongs, as
    bench.decode_step once passed) fails with the name, rather than taking an empty slot that
    samples the base model's tokens and is refilled at every step."""
    layers = lora_layers_of(setup.model)
    slots = AdapterSlots(lora_groups(setup.model, layers), 2, 8, torch.float32)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'m-unknown' adapts none"):
        slots.slots_of(["a1", "m-unknown"])


# --- the pieces ----------------------------------------------------------------------------------
def test_buckets() -> None:
    assert [bucket(n) for n in (1, 2, 3, 5, 8, 9, 33)] == [1, 2, 4, 8, 8, 16, 64]
    assert [graph_rows(n) for n in (1, 2, 3, 5, 8, 9, 33, 64)] == [1, 2, 4, 8, 8, 16, 40, 64]
    assert all(graph_rows(n) <= bucket(n) for n in range(1, 300))  # within the slots
    assert column_bucket(10, 4096) == 256
    assert column_bucket(300, 4096) == 512
    assert column_bucket(1025, 1280) == 1280  # never past what a slot holds


def test_the_decode_step_setting() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert decode_step_of("auto", cpu, grouped=False) == StepKind(slots=False, graphs=False)
    assert decode_step_of("auto", cuda, grouped=False) == StepKind(slots=True, graphs=True)
    assert decode_step_of("graphs", cpu, grouped=False) == StepKind(slots=True, graphs=False)
    assert decode_step_of("slots", cuda, grouped=False) == StepKind(slots=True, graphs=False)
    assert decode_step_of("graphs", cuda, grouped=True) == StepKind(slots=False, graphs=False)
    assert decode_step_of("padded", cuda, grouped=False) == StepKind(slots=False, graphs=False)


def test_a_sliding_window_model_decodes_padded(setup: Setup) -> None:
    """Slots take full attention only: a sliding window's mask is the model's own."""
    rows_cache = _prefilled_cache(setup)
    layers = lora_layers_of(setup.model)
    assert slots_fit(setup.model, layers, rows_cache)
    config = copy.deepcopy(setup.model.config)
    config.sliding_window = 4
    assert not slots_fit(SimpleNamespace(config=config), layers, rows_cache)  # type: ignore[arg-type]


def _prefilled_cache(setup: Setup) -> Any:
    loop = loop_of(setup, False)
    loop.add(0, request(PROMPTS[0], "a1", max_tokens=4, seed=1))
    loop.step(setup.model)
    assert loop.running is not None
    return loop.running.cache


def test_placing_left_padded_rows_puts_each_row_s_tokens_from_column_0() -> None:
    """Rows of a left-padded cache land in their slots from column 0, the padding dropped."""
    from transformers import DynamicCache

    from queue_tinker.workers.sampling.kv_cache import GrowingLayer

    keys = torch.arange(2 * 1 * 4 * 2, dtype=torch.float32).view(2, 1, 4, 2)
    cache = DynamicCache()
    cache.layers = [GrowingLayer.holding(keys, -keys, room=4)]
    slots = KvSlots([(1, 2, 2)], torch.float32, CPU)
    slots.reserve(4, 8, live=0)
    slots.place(1, cache, [2, 4])  # row 0 holds 2 real columns, row 1 all 4
    placed_keys, placed_values = slots.head_major(0)
    assert torch.equal(placed_keys[1, :, :2], keys[0, :, 2:])
    assert torch.equal(placed_keys[2, :, :4], keys[1])
    assert torch.equal(placed_values[2, :, :4], -keys[1])
    assert placed_keys[0].abs().sum() == 0  # slot 0 untouched


def test_a_loop_that_moves_to_a_plain_model_drops_its_lora_slots(setup: Setup) -> None:
    """The worker hands the loop its plain base once the last adapter is gone: the loop's LoRA
    slots (and any step captured with them) go, and base rows sample as on the padded loop."""
    loop = loop_of(setup, True)
    loop.add("adapted", request(PROMPTS[1], "a1", max_tokens=4, seed=1))
    while loop.busy:
        loop.step(setup.model)
    assert loop.slots is not None and loop.slots.adapters is not None
    base = request(PROMPTS[0], None, n=2, max_tokens=6, seed=2, stop=[])
    loop.add("base", base)
    done: dict[Any, SampleResponse] = {}
    while loop.busy:
        done.update(loop.step(setup.plain))
    assert loop.slots.adapters is None and not loop.slots.graphs
    padded = loop_of(setup, False)
    padded.add("base", base)
    want: dict[Any, SampleResponse] = {}
    while padded.busy:
        want.update(padded.step(setup.plain))
    assert_equal_samples(done, want)


def test_grouped_decode_attention_equals_sdpa_with_repeated_heads() -> None:
    """One query token a row, 8 query heads on 2 key / value heads, a mask per row: the grouped
    form equals transformers' sdpa attention (keys and values repeated per query head)."""
    from transformers.integrations.sdpa_attention import repeat_kv

    from queue_tinker.workers.sampling.decode_attention import grouped_decode_attention

    draws = torch.Generator().manual_seed(0)
    query = torch.randn(3, 8, 1, 16, generator=draws)
    key, value = (torch.randn(3, 2, 20, 16, generator=draws) for _ in range(2))
    mask = (torch.arange(20)[None, :] <= torch.tensor([4, 19, 11])[:, None])[:, None, None, :]
    got, _ = grouped_decode_attention(torch.nn.Module(), query, key, value, mask, scaling=0.25)
    want = torch.nn.functional.scaled_dot_product_attention(
        query, repeat_kv(key, 4), repeat_kv(value, 4), attn_mask=mask, scale=0.25
    ).transpose(1, 2)
    assert got.shape == (3, 1, 8, 16)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("slots", [False, True])
def test_decode_steps_attend_grouped_and_sample_as_before(setup: Setup, slots: bool) -> None:
    """Padded and slot decode steps in transformers' layers both run the grouped attention
    (prefill does not), and a padded loop's samples still equal each request's alone
    (test_sampler's reference)."""
    from transformers import AttentionInterface

    from queue_tinker.workers.sampling import decode_attention

    calls: list[int] = []

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(args[1].shape[2])  # the query's length
        return decode_attention.grouped_decode_attention(*args, **kwargs)

    AttentionInterface.register(decode_attention.NAME, counting)
    try:
        arrivals = {0: list(enumerate(mixed_requests()))}
        got, _, _ = run_loop(setup, slots, arrivals, layers="transformers")
    finally:
        AttentionInterface.register(
            decode_attention.NAME, decode_attention.grouped_decode_attention
        )
    assert calls and set(calls) == {1}
    alone = {i: run_loop(setup, False, {0: [(i, r)]})[0][i] for i, r in enumerate(mixed_requests())}
    assert_equal_samples(got, alone)


def test_slots_regrown_for_longer_rows_keep_room_for_every_slot(setup: Setup) -> None:
    """Four rows hold four slots; three leave, a longer request joins (the slots are made
    anew, wider), then two more join into the slots already there: the step's inputs have
    room for all of them (they were once sized to the rows in flight at the regrowth, and the
    next step failed), and the samples are the padded loop's."""
    short = [request(PROMPTS[i], "a1", max_tokens=2 + 6 * (i == 0), seed=i) for i in range(4)]
    arrivals = {
        0: list(enumerate(short)),
        4: [("long", request(PROMPTS[1], "a2", max_tokens=90, seed=7, stop=[]))],
        6: [(f"more-{i}", request(PROMPTS[i], None, max_tokens=5, seed=8 + i)) for i in range(2)],
    }
    want, _, _ = run_loop(setup, False, arrivals)
    got, loop, _ = run_loop(setup, True, arrivals)
    assert_equal_samples(got, want)
    assert loop.slots is not None and loop.slots.tokens.shape[0] == loop.slots.slots.slots


def random_arrivals(
    draws: random.Random, count: int, steps: int, longest: int
) -> dict[int, list[Any]]:
    """`count` requests (key: their index) at random steps below `steps`: random prompts of up
    to `longest` tokens, adapters, sample counts, lengths, settings and stop rules."""
    arrivals: dict[int, list[Any]] = {}
    for index in range(count):
        prompt = [draws.randrange(256) for _ in range(draws.randint(1, longest))]
        settings = draws.choice(
            [{"temperature": 0}, {"top_k": 5}, {"top_p": 0.8}, {"temperature": 0.7}, {}]
        )
        req = request(
            prompt,
            draws.choice(["a1", "a2", "sharp", None]),
            n=draws.randint(1, 3),
            max_tokens=draws.randint(1, 40),
            seed=draws.randrange(1000),
            stop=draws.choice([[], None]),
            **settings,
        )
        arrivals.setdefault(draws.randrange(steps), []).append((index, req))
    return arrivals


@pytest.mark.parametrize("seed", range(8))
def test_random_arrivals_sample_on_slots_what_they_sample_padded(setup: Setup, seed: int) -> None:
    """Seeded random traffic, the same calls on both loops: requests of random prompts, lengths,
    adapters, sample counts and settings arrive at random steps under a random row cap and KV
    budget, one is cancelled mid-way and one moved to other weights; every response is the
    padded loop's (the tokens, and logprobs to float32 rounding)."""
    draws = random.Random(seed)
    options: dict[str, Any] = {
        "max_rows": draws.choice([None, 3, 5]),
        "max_cache_tokens": draws.choice([None, 400]),
    }
    arrivals = random_arrivals(draws, 12, steps=30, longest=40)
    doomed, at = draws.randrange(12), draws.randrange(5, 25)
    moved, to, when = draws.randrange(12), draws.choice(["a1", "a2", None]), draws.randrange(30)
    results = []
    for slots in (False, True):
        loop = loop_of(setup, slots, **options)
        done: dict[Any, SampleResponse] = {}
        step = 0
        while loop.busy or step <= max(arrivals):
            for key, req in arrivals.get(step, []):
                loop.add(key, req)
            if step == at:
                loop.cancel({doomed})
            # Inflight weights move on: the request goes on another adapter. Not under a KV
            # budget, which the two count apart (slots as wide as the widest row), so a part
            # could be admitted before the move in one loop and after it in the other.
            if step == when and options["max_cache_tokens"] is None:
                loop.retarget({moved: to})
            done.update(loop.step(setup.model))
            step += 1
        results.append(done)
    assert_equal_samples(results[1], results[0])


class ReplayedStep:
    """A CUDA graph's part, on the CPU: captured once for (rows, columns), replayed by running
    the step again on whatever the input buffers hold then, into the same output tensor. A
    graph reads and writes the tensors it was captured on: a replay after any of them was
    made anew (a stale graph, which CUDA would replay silently) fails here."""

    def __init__(self, decoder: SlotDecoder, model: torch.nn.Module, size: int, columns: int):
        self.decoder, self.model, self.size, self.columns = decoder, model, size, columns
        self.captured_on = self.tensors()
        self.output = decoder._step(model, size, columns).clone()

    def tensors(self) -> list[torch.Tensor]:
        decoder = self.decoder
        kv = decoder.slots
        stacks = decoder.adapters.a + decoder.adapters.b if decoder.adapters else []
        inputs = [decoder.tokens, decoder.row_slots, kv.write_at]
        if isinstance(kv, KvSlots):
            return [*inputs, *kv.keys, *kv.values, *stacks]
        return [*inputs, *(pool for pair in kv.pages for pool in pair), kv.table, *stacks]

    def replay(self) -> None:
        now = self.tensors()
        assert len(now) == len(self.captured_on)
        assert all(a is b for a, b in zip(now, self.captured_on, strict=True)), "a stale graph"
        self.output.copy_(self.decoder._step(self.model, self.size, self.columns))


def replayed_capture(
    decoder: SlotDecoder, model: torch.nn.Module, size: int, columns: int
) -> tuple[Any, torch.Tensor]:
    step = ReplayedStep(decoder, model, size, columns)
    decoder.graphs[(size, columns, decoder.lora_on)] = (step, step.output)  # type: ignore[assignment]
    decoder.captured += 1
    return step, step.output


@pytest.mark.parametrize("seed", range(4))
def test_bucketed_steps_replayed_sample_what_the_padded_loop_samples(
    setup: Setup, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The graphs' way on the CPU: steps run on batch buckets (empty slots on a dummy token)
    over column buckets, each bucket's step made once and replayed on the input buffers as
    they are at each step. Random traffic gives the padded loop's samples, over several
    buckets."""
    monkeypatch.setattr(SlotDecoder, "_capture", replayed_capture)
    arrivals = random_arrivals(random.Random(100 + seed), 10, steps=20, longest=60)
    want, _, _ = run_loop(setup, False, arrivals)
    loop = loop_of(setup, True)
    assert loop.slots is not None
    loop.slots.graphs_wanted = True  # as on CUDA
    done: dict[Any, SampleResponse] = {}
    step = 0
    while loop.busy or step <= max(arrivals):
        for key, req in arrivals.get(step, []):
            loop.add(key, req)
        done.update(loop.step(setup.model))
        step += 1
    assert_equal_samples(done, want)
    assert loop.slots.captured >= 2 and all(
        size == graph_rows(size) for size, _, _ in loop.slots.graphs
    )


def test_the_next_decode_is_launched_at_the_end_of_a_step_and_run_once(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On slots a step ends by launching the next step's decode (the device runs it while the
    worker does its own work): each decode runs once, consumed by the next step; a cancel
    meanwhile drops it and the next step runs it again for the rows left."""
    calls: list[int] = []
    original = SlotDecoder.decode

    def counted(self: SlotDecoder, model: Any, rows: SlotRows, *args: Any) -> torch.Tensor:
        calls.append(rows.size)
        return original(self, model, rows, *args)

    monkeypatch.setattr(SlotDecoder, "decode", counted)
    loop = loop_of(setup, True)
    for i in range(3):
        loop.add(i, request(PROMPTS[i], "a1", n=2, max_tokens=12, seed=i, stop=[]))
    launched_steps = 0
    for _ in range(4):
        loop.step(setup.model)
        launched_steps += loop.running is not None
        assert (loop._launched is not None) == (loop.running is not None)
    assert calls == [6] * launched_steps  # one decode a step, none run twice
    loop.cancel({1})
    assert loop._launched is None and loop.rows == 4
    loop.step(setup.model)
    assert calls[-2:] == [4, 4]  # run again for the rows left, then the next one launched
