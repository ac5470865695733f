"""The decode step on fixed slots: the rows in flight in KV slots (kv_slots.py), their adapters
in LoRA slots (adapter_slots.py), the step's inputs in static buffers; on CUDA each (rows,
columns) bucket's step is captured once as a CUDA graph and replayed.

An eager decode step of an 8B model launches ~2,300 kernels from Python (every layer's norms,
projections, LoRA updates, rotary, attention), 15-30 ms of host time against ~10 ms of memory
traffic; a replayed graph launches them all at once. For a graph every shape must be fixed and
every tensor read or written must stay where it was captured: so the step runs a batch bucket
of slots (`bucket`: empty slots in it compute on a dummy token, and their outputs are not read)
over a column bucket (`column_bucket`), and its tokens, positions and adapter slots are copied
into buffers the graph reads. A new bucket is captured on first use (a few of each over a run);
the slots' buffers made anew (more rows or columns than they hold, a new adapter that does not
fit the LoRA slots) drop every graph.

Rows leave by giving up their slot (the last rows move into the holes: `SlotRows.select`) and
join by copying their prefill into free slots (`SlotRows.merge`); the loop's admission,
prefill and prefix cache are decode_loop.py's, unchanged.

Without graphs (QT_DECODE_STEP=slots, or the CPU: graphs are CUDA's) the same step runs eagerly
on exactly the rows and columns in use; the tests hold it to the left-padded path's logits and
samples there.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from peft import PeftModel
from peft.tuners.lora import Linear as LoraLinear
from transformers import DynamicCache

from queue_tinker.workers.model.base_model import cache_keyword
from queue_tinker.workers.model.families import family_of
from queue_tinker.workers.model.families.fused_decode import FusedDecoder, SlotLora
from queue_tinker.workers.model.lora.row_blocks import LoraLayer
from queue_tinker.workers.sampling.adapter_slots import (
    BASE_SLOT,
    AdapterSlots,
    lora_groups,
    slots_support,
    slotted_lora,
)
from queue_tinker.workers.sampling.decode_attention import grouped_decode, grouped_decode_fits
from queue_tinker.workers.sampling.decode_rows import (
    BASE_ADAPTER,
    LiveRequest,
    Rows,
    growing_layers,
)
from queue_tinker.workers.sampling.host_reads import to_device
from queue_tinker.workers.sampling.kv_pages import KvPages, pages_for, pool_pages
from queue_tinker.workers.sampling.kv_slots import KvSlots

log = logging.getLogger(__name__)

# LoRA slots at least (more are made when more adapters are in flight at once).
MIN_ADAPTER_SLOTS = 8
# Column buckets are powers of two from this on (capped by what the slots hold).
MIN_COLUMN_BUCKET = 256


DecodeStep = Literal["auto", "padded", "slots", "graphs"]  # QT_DECODE_STEP


@dataclass(frozen=True)
class StepKind:
    """How a decode loop runs its steps: on slots or left-padded; captured or eager."""

    slots: bool
    graphs: bool


PADDED = StepKind(slots=False, graphs=False)


def decode_step_of(setting: DecodeStep, device: torch.device, grouped: bool) -> StepKind:
    """QT_DECODE_STEP on this worker: graphs only on CUDA, padded in a worker group (its
    LoRA layers are split across ranks)."""
    cuda = device.type == "cuda"
    if grouped or setting == "padded" or (setting == "auto" and not cuda):
        return PADDED
    return StepKind(slots=True, graphs=cuda and setting in ("auto", "graphs"))


def bucket(rows: int) -> int:
    """The batch a step of `rows` rows runs: the next power of two."""
    return 1 << max(0, rows - 1).bit_length()


def graph_rows(rows: int) -> int:
    """The rows a captured step of `rows` rows runs: 1, 2, 4, then the next multiple of 8 (as
    vLLM's capture sizes), so a batch pads at most 7 rows where powers of two padded up to
    half of it; each size is one graph. Within the slots' capacity (bucket(rows))."""
    return bucket(rows) if rows <= 4 else -(-rows // 8) * 8


def column_bucket(columns: int, capacity: int) -> int:
    """The columns a step attends over: the next power of two (MIN_COLUMN_BUCKET at least),
    never past what a slot holds."""
    return min(capacity, max(MIN_COLUMN_BUCKET, 1 << max(0, columns - 1).bit_length()))


def slots_fit(model: torch.nn.Module, layers: Sequence[LoraLayer], cache: DynamicCache) -> bool:
    """Whether a model's decode steps can run on slots: plain per-layer key / value caches,
    full attention in every layer (no sliding window: its mask is the model's own) by sdpa or
    eager, token positions of one axis (a vision-language model's are not), plain LoRA
    linears."""
    return (
        grouped_decode_fits(model) and growing_layers(cache) is not None and slots_support(layers)
    )


@dataclass(eq=False)
class SlotRows(Rows):
    """The rows in flight, row i in slot i of `decoder`'s KV slots; `next_pos` is also the
    column each row writes next. `mask` is not kept (a row's filled columns are 0..next_pos)."""

    decoder: SlotDecoder = field(kw_only=True)

    @classmethod
    def adopt(cls, rows: Rows, decoder: SlotDecoder) -> SlotRows:
        """The first rows in flight, moved into slots 0, 1, ..."""
        slotted = cls(
            requests=[],
            samples=[],
            cache=rows.cache,
            mask=rows.mask[:0, :0],
            next_pos=rows.next_pos[:0],
            temperature=rows.temperature[:0],
            top_k=rows.top_k[:0],
            top_p=rows.top_p[:0],
            greedy=rows.greedy[:0],
            streams=rows.streams[:0],
            steps=rows.steps[:0],
            stop_ids=rows.stop_ids[:0],
            tokens=rows.tokens[:0],
            decoder=decoder,
        )
        slotted.merge(rows)
        return slotted

    def mergeable(self) -> bool:
        return True

    def close(self) -> None:
        """Every row left: their slots (pages) given back."""
        self.decoder.slots.release(list(range(self.size)))

    def select(self, keep: list[int]) -> None:
        """Keep these rows: those past the kept count move into the slots of those that left
        (the rest keep theirs), so only moved rows' columns are copied."""
        count = len(keep)
        kept = set(keep)
        self.decoder.slots.release([row for row in range(self.size) if row not in kept])
        if sorted(keep) == keep:
            staying = {row for row in keep if row < count}
            holes = [slot for slot in range(count) if slot not in staying]
            movers = [row for row in keep if row >= count]
            order = list(range(count))
            for hole, row in zip(holes, movers, strict=True):
                order[hole] = row
            self.decoder.slots.move(movers, holes)
        else:  # a reordering: every row whose slot changes moves
            order = keep
            moved = [slot for slot, row in enumerate(keep) if row != slot]
            self.decoder.slots.move([keep[slot] for slot in moved], moved)
        index = to_device(order, torch.long, self.next_pos.device)
        self.requests = [self.requests[i] for i in order]
        self.samples = [self.samples[i] for i in order]
        self._index_fields(index)

    def merge(self, other: Rows) -> None:
        """Append `other`'s rows (a prefill's left-padded cache) in the next free slots."""
        lengths = other.row_lengths()  # known on the host: no read of the mask
        ends = [_end(request) for request in other.requests]
        columns = max(_end(request) for request in [*self.requests, *other.requests])
        self.decoder.reserve(self.size + other.size, columns, self.size, other.cache, ends)
        self.decoder.slots.place(self.size, other.cache, lengths, ends)
        self._append_fields(other)
        self.requests += other.requests
        self.samples += other.samples


def _end(request: LiveRequest) -> int:
    """The columns a row of the request is given: its prompt's and its new tokens' (the last
    is never fed back, so one stays spare)."""
    return len(request.spec.prompt) + request.spec.max_tokens


class SlotDecoder:
    """The slots of a decode loop, and the steps captured on them."""

    def __init__(
        self,
        device: torch.device,
        graphs: bool,
        fused: bool = True,
        cache_tokens: int | None = None,
        most_rows: int | None = None,
    ) -> None:
        self.device = device
        # What the fused step's page pool is sized by (kv_pages.py): the budget of cache
        # tokens, the most rows at once.
        self.cache_tokens, self.most_rows = cache_tokens, most_rows
        self.row_columns = 0  # the most columns a row may have (the model's positions)
        self.graphs_wanted = graphs and device.type == "cuda"
        # The family's fused step (families/fused_decode.py) where it has one, made for the
        # model last stepped; else transformers' layers on the slots.
        self.fused_wanted = fused
        self._fused: tuple[torch.nn.Module, FusedDecoder | None] | None = None
        # Made from the first rows' prefill: pages for the fused step, else slots.
        self.kv: KvSlots | KvPages | None = None
        self.adapters: AdapterSlots | None = None
        self.tokens = torch.zeros(0, dtype=torch.long, device=device)
        self.row_slots = torch.zeros(0, dtype=torch.long, device=device)
        # By (rows, columns, whether LoRA applies).
        self.graphs: dict[tuple[int, int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.lora_on = False  # whether the next step's rows use an adapter
        self._pool: Any = None  # the graphs' shared memory pool
        self.captured = 0  # graphs captured so far (a statistic)

    @property
    def slots(self) -> KvSlots | KvPages:
        assert self.kv is not None, "no rows have joined yet"
        return self.kv

    def bind(self, model: torch.nn.Module) -> None:
        """The model the first rows decode on: its fused step made (if its family has one), so
        that their KV goes to pages."""
        self._decoder(model)
        config = getattr(model, "config", None)
        self.row_columns = int(getattr(config, "max_position_embeddings", 0) or 0)

    def reserve(
        self, rows: int, columns: int, live: int, like: DynamicCache, ends: list[int]
    ) -> None:
        """Room for `rows` rows of `columns` columns (the joiners' ends `ends`), the first
        `live` rows kept."""
        if self.kv is None:
            if self._fused is not None and self._fused[1] is not None:
                most = bucket(max(rows, self.most_rows or 0))
                pages = pool_pages(self.cache_tokens, most, ends)
                row_pages = pages_for(max(columns, min(self.row_columns, 1 << 20)))
                self.kv = KvPages.like(like, pages, most, row_pages)
            else:
                self.kv = KvSlots.like(like)
            self._inputs(self.kv.slots)
        if self.kv.reserve(bucket(rows), columns, live, ends):
            self._inputs(self.kv.slots)  # as many as the slots (which never shrink)
            self.graphs.clear()

    def _inputs(self, slots: int) -> None:
        """The step's token and adapter-slot buffers, `slots` long (written at every step)."""
        self.tokens = torch.zeros(slots, dtype=torch.long, device=self.device)
        self.row_slots = torch.zeros(slots, dtype=torch.long, device=self.device)
        self.written_slots: list[int] = []  # what row_slots holds: copied when it changes

    @torch.inference_mode()
    def decode(
        self,
        model: torch.nn.Module,
        rows: SlotRows,
        layers: Sequence[LoraLayer],
        lora_compute: torch.dtype | None,
    ) -> torch.Tensor:
        """Every row's logits (rows, vocab) for its next token, after its last token is fed
        at its position (written to its slot's column there)."""
        kv = self.slots
        count = rows.size
        # Buckets keep a captured graph's shapes; an eager step runs what the rows use.
        size = graph_rows(count) if self.graphs_wanted else count
        self.tokens[:count].copy_(rows.tokens)
        kv.write_at[:count].copy_(rows.next_pos)  # a row's position is the column it writes
        self.tokens[count:size].zero_()
        kv.write_at[count:size].zero_()
        names = [None if name == BASE_ADAPTER else name for name in rows.adapters]
        self._slot_adapters(model, layers, names, lora_compute)
        if self.adapters is not None:
            # Rows keep their adapters from step to step: copied only when rows join or leave.
            slots = self.adapters.slots_of(names) + [BASE_SLOT] * (size - count)
            if slots != self.written_slots:
                on_device = to_device(slots, self.row_slots.dtype, self.row_slots.device)
                self.row_slots[:size].copy_(on_device)
                self.written_slots = slots
        # A step whose rows are all on the base model launches no LoRA kernel (its own graph).
        self.lora_on = self.adapters is not None and any(
            slot != BASE_SLOT for slot in self.written_slots
        )
        # The columns in use, known on the host (next_pos is on the device): a row has its
        # prompt's and its tokens' but the last, which it is fed now.
        used = max(
            len(request.spec.prompt) + len(request.tokens[sample])
            for request, sample in zip(rows.requests, rows.samples, strict=True)
        )
        columns = column_bucket(used, kv.capacity) if self.graphs_wanted else used
        if isinstance(kv, KvPages):
            columns = 0  # the fused step reads each row's own length: one graph a row count
        kv.rows, kv.columns = size, columns
        if not self.graphs_wanted:
            return self._step(model, size, columns)[:count]
        graph = self.graphs.get((size, columns, self.lora_on))
        if graph is None:
            try:
                graph = self._capture(model, size, columns)
            except RuntimeError:  # a model whose step cannot be captured still samples
                log.exception("capturing the decode step failed: steps run eagerly from now on")
                self.graphs_wanted = False
                self.graphs.clear()
                return self._step(model, size, columns)[:count]
        graph[0].replay()
        return graph[1][:count]

    def _slot_adapters(
        self,
        model: torch.nn.Module,
        layers: Sequence[LoraLayer],
        names: Sequence[str | None],
        lora_compute: torch.dtype | None,
    ) -> None:
        """LoRA slots holding every adapter the rows name (made anew, and the graphs dropped,
        when they do not fit)."""
        if not isinstance(model, PeftModel) or not layers:
            if self.adapters is not None:  # the graphs add the slots' updates: not any more
                self.adapters = None
                self.graphs.clear()
            return
        linears = [layer for layer in layers if isinstance(layer, LoraLinear)]
        wanted = [name for name in names if name is not None]
        if self.adapters is not None and self.adapters.fits(wanted, linears):
            return
        count = max(MIN_ADAPTER_SLOTS, bucket(len(set(wanted))))
        # As wide as every adapter the model holds, so that one of them arriving later fits.
        resident = {name for layer in linears for name in layer.lora_A}
        rank = max(AdapterSlots.widest_rank(linears, resident | set(wanted)), 1)
        dtype = lora_compute or linears[0].lora_A[next(iter(linears[0].lora_A))].weight.dtype
        groups = lora_groups(model, linears)
        self.adapters = AdapterSlots(groups, count, rank, dtype)  # type: ignore[arg-type]
        self.graphs.clear()

    def _decoder(self, model: torch.nn.Module) -> FusedDecoder | None:
        """The model's fused step, if its family has one that fits it (made once a model)."""
        if self._fused is None or self._fused[0] is not model:
            config = getattr(model, "config", None)
            family = family_of(config) if config is not None else None
            made = family.decoder if family is not None and self.fused_wanted else None
            self._fused = (model, made(model) if made is not None else None)  # type: ignore[arg-type]
        return self._fused[1]

    def _step(self, model: torch.nn.Module, size: int, columns: int) -> torch.Tensor:
        """The step itself, on the input buffers: logits (size, vocab)."""
        kv = self.slots
        decoder = self._decoder(model) if isinstance(kv, KvPages) else None
        if decoder is not None and isinstance(kv, KvPages):
            slots = self.adapters if self.lora_on else None
            lora = SlotLora(slots.stacks, slots.rank, self.row_slots[:size]) if slots else None
            positions = kv.write_at[:size]
            return decoder.step(self.tokens[:size], positions, kv.pages, kv.table[:size], lora)
        slotted = self.slots
        assert isinstance(slotted, KvSlots), "pages are the fused step's"
        positions = slotted.write_at[:size]
        filled = torch.arange(columns, device=self.device)[None, :] <= positions[:, None]
        kwargs = {
            "input_ids": self.tokens[:size, None],
            "position_ids": positions[:, None],
            "attention_mask": filled[:, None, None, :],
            cache_keyword(model): slotted.cache(),
            "use_cache": True,
        }
        with grouped_decode(model):
            if self.adapters is None:  # (a PeftModel's own forward would add its adapter)
                return model(**kwargs).logits[:, -1]
            with slotted_lora(self.adapters, self.row_slots[:size]):
                return model(**kwargs).logits[:, -1]

    def _capture(
        self, model: torch.nn.Module, size: int, columns: int
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """The step of this bucket captured as a CUDA graph (after one eager run on a side
        stream, which lazy initialisations need, and the kernels' first compile; the run writes
        what the replay writes). Its time is logged: a first step per bucket pays it once."""
        began = time.perf_counter()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._step(model, size, columns)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        # thread_local: the worker's other threads (its heartbeat reads the allocator's
        # statistics) may call into CUDA meanwhile; only this thread's calls are captured.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            logits = self._step(model, size, columns)
        self.graphs[(size, columns, self.lora_on)] = (graph, logits)
        self.captured += 1
        log.info(
            "captured the decode step of %d rows (%s, %s) in %.2f s",
            size,
            f"{columns} columns" if columns else "each row's own length",
            "LoRA" if self.lora_on else "no LoRA",
            time.perf_counter() - began,
        )
        return graph, logits
