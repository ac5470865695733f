"""Generation: sample requests on many adapters in one KV-cached decoding loop that requests
join and leave between steps (continuous batching).

A `DecodeLoop` keeps its KV cache and its live rows (one per sample) from one `step` to the
next. A step first feeds every live row its last chosen token (one decode step), then admits
waiting requests: their prompts are prefilled (left-padded, in groups of similar length:
prefill_groups.py; one prefill row per distinct prompt and adapter, so a request's `num_samples`
rows, and identical prompts admitted together, share it; the cache is then expanded to one row
per sample, in layers a decode step writes in place: kv_cache.py), their first tokens are
chosen, and their rows are appended to the running batch (the shorter cache left-padded to the
longer). Prompts are shared across steps too, through a prefix cache
(workers/sampling/prefix_cache.py): a prefilled prompt's own key / value states and last logits
are kept (least recently used out), a request with the same prompt and adapter joins from them
without prefilling, and one whose prompt begins with a kept one prefills only the rest, unless it
wants its prompt scored. A row that finishes leaves at once, and columns no remaining
row uses are cut off; a request is done when its last row is.

Each row keeps its own adapter (the rows of one adapter kept together, and each block of them
gets its adapter's update in every LoRA layer: row_blocks.py), its sampling settings, stop rules
and position ids; left padding under the attention mask and explicit positions make a row
compute what it would alone, up to float rounding. Each sample draws its uniforms from its own
stream (fixed by its request's seed and its index), made on the device and counted in its own
steps, so its tokens do not depend on what else is in the loop or when it joined. A
request with more samples than the loop has rows for, or than its KV-cache budget holds
(cache_budget.py), joins in parts.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence, Set
from contextlib import contextmanager
from dataclasses import dataclass, replace
from weakref import WeakKeyDictionary

import torch
import torch.nn.functional as F

from queue_tinker.types.requests.sampling import SampleResponse, SamplingParams
from queue_tinker.workers.model.lora.row_blocks import (
    LoraLayer,
    grouped_order,
    lora_layers_of,
)
from queue_tinker.workers.model.vision_language import ImageInputs
from queue_tinker.workers.sampling import prefix_prefill
from queue_tinker.workers.sampling.admission import Admission
from queue_tinker.workers.sampling.cache_budget import (
    CacheRow,
)
from queue_tinker.workers.sampling.decode_attention import grouped_decode, grouped_decode_fits
from queue_tinker.workers.sampling.decode_rows import (
    Key,
    LiveRequest,
    Rows,
    kept,
)
from queue_tinker.workers.sampling.model_call import ModelCall
from queue_tinker.workers.sampling.prefill_groups import prefill_call_tokens, prefill_prompts
from queue_tinker.workers.sampling.prefix_cache import (
    PrefixCache,
)
from queue_tinker.workers.sampling.slot_decode import SlotDecoder, SlotRows, slots_fit
from queue_tinker.workers.sampling.step_outputs import record_step
from queue_tinker.workers.sampling.token_choice import (
    Choices,
    Cuts,
    choose,
    step_uniforms,
)

# Padded prompt tokens (prefill rows x longest prompt) one step prefills at most; a request
# bigger than that goes alone. It keeps a step short however many requests arrive at once: a
# step is the worker's scheduling quantum, what other models' ops wait for at most.
PREFILL_TOKENS = 4096

Finished = list[tuple[Key, SampleResponse]]


@dataclass(frozen=True)
class GenerationRequest:
    """One sample op, already checked (check_sample) and resolved."""

    prompt: list[int]
    num_samples: int
    params: SamplingParams
    max_tokens: int  # resolved: params.max_tokens, or what the context leaves
    prompt_logprobs: bool
    adapter: str | None  # the PEFT adapter name to sample with; None: the base model
    prompt_topk: int = 0  # prompt_scores.py: top-k logprobs at each prompt position
    prompt_targets: list[list[int]] | None = None  # ids to score at each prompt position
    prompt_alt_k: int = 0  # prompt_scores.py: draws at each prompt position
    sample_topk: int = 0  # top-k logprobs at each generated position
    images: ImageInputs | None = None  # a prompt's images: `prompt` holds their placeholders


def generate(
    model: torch.nn.Module,
    requests: Sequence[GenerationRequest],
    *,
    device: torch.device,
    eos_token_ids: Sequence[int],
    decode: Callable[[list[int]], str],
    lora_compute: torch.dtype | None = None,
) -> list[SampleResponse]:
    """One response per request, in order: `num_samples` sequences each (plus prompt logprobs
    when asked), all requests prefilled together and decoded in one loop. `model` is a
    PeftModel holding every adapter named, or a plain causal LM when all requests are on the
    base model. It runs in eval mode and is left in the mode it came in. `lora_compute`: the
    dtype of LoRA's matmuls, as the worker's pool sets it (None: the adapters' own).
    """
    loop = DecodeLoop(device, eos_token_ids, decode, max_rows=None, prefill_tokens=None)
    for index, request in enumerate(requests):
        loop.add(index, request)
    layers = lora_layers_of(model)
    responses: dict[Key, SampleResponse] = {}
    while loop.busy:
        responses.update(loop.step(model, layers, lora_compute))
    return [responses[index] for index in range(len(requests))]


# The modules of a model found in training mode, per set of adapters it holds and mode of its
# root: a walk of every module cost 0.18 ms a step on the tiny model with 3 adapters (233
# modules, ~0.8 us each), so ~5 ms at the 8B shape with 8 adapters on every linear (~7,000),
# more than a captured decode step's replay. Modules come and go with adapters only
# (get_peft_model, add_adapter, delete_adapter), model.train() / eval() flip the root's flag
# too, and the worker switches no single module between steps.
_TRAINING: WeakKeyDictionary[torch.nn.Module, tuple[object, list[torch.nn.Module]]] = (
    WeakKeyDictionary()
)


def _in_training_mode(model: torch.nn.Module) -> list[torch.nn.Module]:
    key = (tuple(getattr(model, "peft_config", None) or ()), model.training)
    kept = _TRAINING.get(model)
    if kept is None or kept[0] != key:
        kept = _TRAINING[model] = (key, [m for m in model.modules() if m.training])
    return kept[1]


@contextmanager
def _eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """Eval mode meanwhile: LoRA's dropout is for training (and get_peft_model / add_adapter
    hand back modules in training mode); each module's own flag is restored. Only
    modules in training mode are touched (model.eval() on every step cost ~0.5 ms), found once
    per set of adapters (`_TRAINING`)."""
    training = _in_training_mode(model)
    for module in training:
        module.training = False
    try:
        yield
    finally:
        for module in training:
            module.training = True


@dataclass(frozen=True)
class _Launched:
    """A decode step launched ahead, and what it ran on."""

    logits: torch.Tensor
    model: torch.nn.Module
    layers: tuple[LoraLayer, ...]
    lora_compute: torch.dtype | None

    def ran(
        self, model: torch.nn.Module, layers: Sequence[LoraLayer], compute: torch.dtype | None
    ) -> bool:
        return self.model is model and self.layers == tuple(layers) and self.lora_compute == compute


# --- the loop -----------------------------------------------------------------------------------
class DecodeLoop:
    """Requests wait (`add`), join the running batch at a step, and leave it when done.

    Not thread-safe: one thread drives it (the worker's compute thread).
    """

    def __init__(
        self,
        device: torch.device,
        eos_token_ids: Sequence[int],
        decode: Callable[[list[int]], str],
        *,
        max_rows: int | None,
        prefill_tokens: int | None = PREFILL_TOKENS,
        call_tokens: int | None = None,
        max_cache_tokens: int | None = None,
        row_cache_tokens: int = 0,
        slots: bool = False,
        graphs: bool = False,
        fused: bool = True,
    ) -> None:
        self.device = device
        self.eos_token_ids = list(eos_token_ids)
        self.decode = decode
        # Who joins the rows at a step, under the loop's budgets (admission.py).
        self.admission = Admission(
            max_rows, max_cache_tokens, row_cache_tokens, prefill_tokens, slots=slots
        )
        # What a prefill call costs in padded tokens' worth (prefill_groups.py).
        self.call_tokens = prefill_call_tokens(device) if call_tokens is None else call_tokens
        self.waiting: deque[LiveRequest] = deque()
        self.running: Rows | None = None
        self.prompts = PrefixCache()  # prompts prefilled before, for requests that share them
        self.prefilled_tokens = 0  # prompt tokens run through the model so far (a statistic)
        self.step_rows = 0  # the most rows the last step ran at once (a statistic)
        # Prompt tokens prefilled for each request that finished in the last step.
        self.finished_prefilled: dict[Key, int] = {}
        self.call = ModelCall()  # the model call of this step (its LoRA layers, their dtype)
        # Decode steps on fixed slots (slot_decode.py), captured as CUDA graphs if `graphs`,
        # in the family's fused step if `fused` and it has one; None: on the left-padded cache
        # of kv_cache.py.
        self.slots = (
            SlotDecoder(device, graphs, fused, max_cache_tokens, max_rows) if slots else None
        )
        # On slots, the next decode step is launched at the end of a step, so the device runs
        # it while the worker does its own work until the next: consumed by that step, dropped
        # when rows are cancelled or moved meanwhile (launched again: it writes the same
        # columns). None: none in flight.
        self._launched: _Launched | None = None

    @property
    def busy(self) -> bool:
        return bool(self.waiting) or self.running is not None

    @property
    def rows(self) -> int:
        return self.running.size if self.running is not None else 0

    def add(self, key: Key, request: GenerationRequest) -> None:
        """Queue a request; it joins at the next step with room for it (FIFO)."""
        live = LiveRequest.make(key, request, self.eos_token_ids)
        self.prompts.enter(live)
        self.waiting.append(live)

    def cancel(self, keys: Set[Key]) -> None:
        """Forget these requests, waiting or running (their results would go nowhere)."""
        running = self.running.requests if self.running is not None else []
        # A request joining in parts is both waiting and running: it leaves once.
        for request in {id(r): r for r in [*self.waiting, *running] if r.key in keys}.values():
            self.prompts.leave(request)
        self.waiting = deque(r for r in self.waiting if r.key not in keys)
        if self.running is not None:
            keep = [i for i, r in enumerate(self.running.requests) if r.key not in keys]
            if len(keep) < self.running.size:
                self._launched = None  # it ran the rows as they were
            self.running = kept(self.running, keep)

    def retarget(self, adapters: Mapping[Key, str | None]) -> None:
        """Move requests (key -> adapter) to other weights, as inflight weights move on: each
        keeps its rows, their KV cache (computed on the old weights) and its random streams,
        and runs on the new adapter from the next step on; a part still waiting for rows is
        prefilled on it."""
        running = self.running.requests if self.running is not None else []
        moved = {id(r): r for r in [*self.waiting, *running] if r.key in adapters}
        if any(r.key in adapters for r in running):
            self._launched = None  # it ran them on the old weights
        for request in moved.values():
            self.prompts.leave(request)  # its prompt's kept prefill is the old adapter's
            request.spec = replace(request.spec, adapter=adapters[request.key])
            self.prompts.enter(request)
        padded = self.running is not None and not isinstance(self.running, SlotRows)
        if self.running is not None and moved and padded:  # one block of rows per adapter
            order = grouped_order(self.running.adapters)
            if order != list(range(self.running.size)):
                self.running.select(order)

    def clear(self) -> list[Key]:
        """Forget everything (after a failed step: the cache may be half-updated); the keys of
        the requests that were in the loop."""
        requests = list(self.waiting) + (self.running.requests if self.running else [])
        self.waiting.clear()
        self.running = None
        self._launched = None
        self.prompts.clear()
        if self.slots is not None:  # a failed step may have left a capture half made
            old = self.slots
            self.slots = SlotDecoder(
                self.device, old.graphs_wanted, old.fused_wanted, old.cache_tokens, old.most_rows
            )
        return list(dict.fromkeys(r.key for r in requests))

    def step(
        self,
        model: torch.nn.Module,
        lora_layers: Sequence[LoraLayer] | None = None,
        lora_compute: torch.dtype | None = None,
    ) -> Finished:
        """One decode step of the running rows, then the admission of waiting requests; the
        requests that finished in it, with their responses. `model` may be a different wrapper
        each call (a PeftModel made meanwhile around the same base): the cache is the loop's.
        `lora_layers`: every LoRA layer of the model, if the caller keeps the list
        (row_blocks.lora_layers_of); None walks the model's modules for it. `lora_compute`: the
        dtype of LoRA's matmuls (None: the adapters' own)."""
        finished: Finished = []
        self.finished_prefilled = {}
        layers = lora_layers_of(model) if lora_layers is None else lora_layers
        self.call = ModelCall(layers, lora_compute)
        self.step_rows = self.rows
        with torch.inference_mode(), _eval_mode(model):
            if self.running is not None:
                self._decode(model, finished)
            admits = self.waiting and (self.running is None or self.running.mergeable())
            if admits and not self._prefill_chunk(model):
                self._admit(model, finished)
            self._launch(model)
        self.admission.fit_prompts(self.prompts, self._cache_rows())
        return finished

    def _launch(self, model: torch.nn.Module) -> None:
        """On slots, the next step's decode of the rows now running, started now."""
        if isinstance(self.running, SlotRows):
            assert self.slots is not None
            logits = self.slots.decode(
                model, self.running, self.call.layers, self.call.lora_compute
            )
            self._launched = _Launched(
                logits, model, tuple(self.call.layers), self.call.lora_compute
            )

    # --- model calls ---
    def _decode(self, model: torch.nn.Module, finished: Finished) -> None:
        rows = self.running
        assert rows is not None
        if isinstance(rows, SlotRows):
            assert self.slots is not None
            launched, self._launched = self._launched, None
            if launched is not None and launched.ran(
                model, self.call.layers, self.call.lora_compute
            ):
                logits = launched.logits
            else:  # none in flight, or on another model since
                logits = self.slots.decode(model, rows, self.call.layers, self.call.lora_compute)
            rows.next_pos = rows.next_pos + 1
            self.running = kept(rows, self._advance(rows, logits, finished))
            return
        mask = F.pad(rows.mask, (0, 1), value=1)
        ids, positions = rows.tokens[:, None], rows.next_pos[:, None]
        if grouped_decode_fits(model):  # a query's heads as one group per key / value head
            with grouped_decode(model):
                attend = mask[:, None, None, :].bool()
                logits = self.call(model, ids, attend, positions, rows.cache, rows.adapters)
        else:
            logits = self.call(model, ids, mask, positions, rows.cache, rows.adapters)
        logits = logits[:, -1]
        rows.mask, rows.next_pos = mask, rows.next_pos + 1
        self.running = kept(rows, self._advance(rows, logits, finished))

    def _admit(self, model: torch.nn.Module, finished: Finished) -> None:
        running = self._cache_rows()
        taken = self.admission.take(self.waiting, running, self.rows)
        if not taken:
            return  # the first in line waits for rows to free
        # Room for the taken rows first: kept prompts give way before their prefill.
        joiners = [self.admission.joining_row(r) for r, samples in taken for _ in samples]
        self.admission.fit_prompts(self.prompts, running + joiners)
        cached, fresh, entries, hits = prefix_prefill.look_up(self.prompts, taken)
        parts: list[tuple[Rows, torch.Tensor]] = []
        if fresh:
            parts, prefilled = prefill_prompts(
                self.call, model, self.prompts, fresh, self.device, self.call_tokens
            )
            self.prefilled_tokens += prefilled
        if hits:
            extended, prefilled = prefix_prefill.extend(
                self.call, model, self.prompts, hits, cached, self.device
            )
            entries.update(extended)
            self.prefilled_tokens += prefilled
        for request, _ in taken:
            self.prompts.unpin(request)  # it joined: its chunks are kept like any prompt
        if cached:
            parts.append(self.prompts.rows(cached, entries))
        self.step_rows = max(self.step_rows, self.rows + sum(rows.size for rows, _ in parts))
        for incoming, logits in parts:
            joining = kept(incoming, self._advance(incoming, logits, finished))
            if joining is None:
                continue
            if self.running is None:
                self.running = self._first_rows(model, joining)
            else:
                self.running.merge(joining)
        if self.running is not None and not isinstance(self.running, SlotRows):
            # One block of rows per adapter (row_blocks.py); slots need none.
            order = grouped_order(self.running.adapters)
            if order != list(range(self.running.size)):
                self.running.select(order)

    def _first_rows(self, model: torch.nn.Module, rows: Rows) -> Rows:
        """The rows that start a batch: in slots when the loop decodes on slots and the model
        allows it (slot_decode.slots_fit), else as they are."""

        if self.slots is None or not slots_fit(model, self.call.layers, rows.cache):
            return rows
        self.slots.bind(model)
        return SlotRows.adopt(rows, self.slots)

    def _prefill_chunk(self, model: torch.nn.Module) -> bool:
        """While rows run, the next chunk of the first waiting prompt if it has more than a
        step's prefill left (prefix_prefill.py); whether it did (then no one joins this step:
        they wait behind it, first come first served)."""
        budget = self.admission.prefill_tokens
        if self.running is None or budget is None:
            return False
        chunk = prefix_prefill.next_chunk(
            self.call, model, self.prompts, self.waiting[0], budget, self.device
        )
        self.prefilled_tokens += chunk
        return chunk > 0

    def _cache_rows(self) -> list[CacheRow]:
        """Each running row's (tokens now, steps it may still take), for cache_budget.py."""
        if self.running is None:
            return []
        return self.admission.cache_rows(self.running.requests, self.running.samples)

    # --- choosing and stopping ---
    def _advance(self, rows: Rows, logits: torch.Tensor, finished: Finished) -> list[int]:
        """Choose every row's next token, record it and end the rows it ends
        (step_outputs.py); a request ends with its last row. The rows that go on."""
        wanted = [r.spec.sample_topk for r in rows.requests]
        keep, ended = record_step(rows, self._choose(rows, logits, wanted), wanted, self.decode)
        for request in ended:
            finished.append((request.key, request.response()))
            self.finished_prefilled[request.key] = request.prefilled
            self.prompts.leave(request)
        return keep

    def _choose(self, rows: Rows, logits: torch.Tensor, wanted: list[int]) -> Choices:
        """Each row's next token (argmax for greedy rows; the others draw with their uniform
        for this step, made on the device from their stream and step) and the model's
        logprobs. Whether any row draws or cuts is known on the host from the rows' settings:
        nothing here waits for the device or copies to it."""
        drawing = [r.spec.params for r in rows.requests if not r.greedy]
        return choose(
            logits,
            rows.greedy,
            rows.temperature,
            rows.top_k,
            rows.top_p,
            step_uniforms(rows.streams, rows.steps) if drawing else None,
            Cuts.of(drawing, logits.shape[-1]),
            wanted,
        )
