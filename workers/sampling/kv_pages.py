"""The fused decode step's KV cache in pages: per attention layer one pool of keys and one of
values, (pages, PAGE_SIZE, heads, dim), shared by the rows in flight; a row holds the pages of
its whole life (its prompt's and its max_tokens' columns) from the step it joins to the step it
leaves, listed in its row of the page table (`table`, on the device: what the kernels read).

Against the slots of kv_slots.py, where every slot is as wide as the widest row: a row takes
only its own columns (a page's rounding at most), a row leaving frees its pages and the rows
moving into its place move their row of the table (a few bytes, not their keys and values),
and the pool and the table keep their addresses for the run, so a captured step is never
dropped for them. The pool is sized once from the sampler's budget of cache tokens
(QT_SAMPLE_CACHE_TOKENS, or its share of the device); without one it grows, doubling, when
rows need more pages than are free, and then the graphs go (reserve says so).

Page 0 is scratch: the table's empty rows point there, so a batch bucket's empty slots, which
compute on a dummy token at position 0, write nowhere a row reads.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from queue_tinker.workers.sampling.decode_rows import growing_layers
from queue_tinker.workers.sampling.host_reads import to_device
from queue_tinker.workers.sampling.kv_slots import Layout, cache_layout

# Columns a page holds (a row's last page is partly used): the attention kernel's block of keys.
PAGE_SIZE = 64
SCRATCH = 0  # the page the table's empty rows point at


def pages_for(columns: int) -> int:
    return -(-columns // PAGE_SIZE)


class KvPages:
    """Every attention layer's page pools, the rows' pages and what the next step reads."""

    def __init__(
        self,
        layout: Layout,
        dtype: torch.dtype,
        device: torch.device,
        pages: int,
        rows: int,
        row_pages: int,
    ) -> None:
        self.layout = layout  # per layer (heads, key dim, value dim)
        self.dtype, self.device = dtype, device
        self.pages: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.free: list[int] = []
        self.held: list[list[int]] = []  # each slot's pages, in order
        self.table = torch.zeros(0, 0, dtype=torch.int32, device=device)
        self.write_at = torch.zeros(0, dtype=torch.long, device=device)
        self.rows = 0  # slots the next step runs
        self.columns = 0  # unused: the kernels read each row's own length
        self._pool(pages)
        self._table(rows, row_pages, live=0)

    @classmethod
    def like(cls, cache: DynamicCache, pages: int, rows: int, row_pages: int) -> KvPages:
        """Empty pools for caches shaped like this one (a prefill's GrowingLayers)."""
        return cls(*cache_layout(cache), pages, rows, row_pages)

    @property
    def slots(self) -> int:
        return self.table.shape[0]

    @property
    def capacity(self) -> int:
        """Columns a row may hold."""
        return self.table.shape[1] * PAGE_SIZE

    @torch.inference_mode()
    def reserve(self, slots: int, columns: int, live: int, ends: list[int]) -> bool:
        """Room for `slots` rows of up to `columns` columns and free pages for rows joining
        with these `ends`; the first `live` rows kept. Whether buffers were made anew."""
        remade = False
        if slots > self.slots or pages_for(columns) > self.table.shape[1]:
            self._table(max(slots, self.slots), max(pages_for(columns), self.table.shape[1]), live)
            remade = True
        wanted = sum(pages_for(end) for end in ends)
        if wanted > len(self.free):
            total = self.pages[0][0].shape[0]
            self._pool(max(2 * total, total + wanted - len(self.free)))
            remade = True
        return remade

    @torch.inference_mode()  # the pools are inference tensors; a cancel comes between steps
    def place(self, at: int, cache: DynamicCache, lengths: list[int], ends: list[int]) -> None:
        """A left-padded cache's rows (row r's real tokens its last lengths[r] columns) into
        slots at, at+1, ..., each given the pages of its `ends[r]` columns."""
        layers = growing_layers(cache)
        assert layers is not None
        width = layers[0].states()[0].shape[2]
        rows, columns, targets = [], [], []
        for r, (length, end) in enumerate(zip(lengths, ends, strict=True)):
            slot = at + r
            self.held[slot] = [self.free.pop() for _ in range(pages_for(end))]
            # On the host, a tensor a row (a prompt of thousands of tokens is one op, not a loop).
            t = torch.arange(length)
            pages = torch.tensor(self.held[slot], dtype=torch.long)
            rows.append(torch.full((length,), r))
            columns.append(width - length + t)
            targets.append(pages[t // PAGE_SIZE] * PAGE_SIZE + t % PAGE_SIZE)
        self._write_table(list(range(at, at + len(lengths))))
        source_row = to_device(torch.cat(rows), torch.long, self.device)
        source_column = to_device(torch.cat(columns), torch.long, self.device)
        target = to_device(torch.cat(targets), torch.long, self.device)
        for layer, pools in zip(layers, self.pages, strict=True):
            for pool, states in zip(pools, layer.states(), strict=True):
                flat = pool.view(-1, *pool.shape[2:])  # (pages * PAGE_SIZE, heads, dim)
                flat.index_copy_(0, target, states[source_row, :, source_column])

    @torch.inference_mode()
    def release(self, slots: list[int]) -> None:
        """These slots' rows left: their pages are free, their table rows scratch."""
        for slot in slots:
            self.free.extend(self.held[slot])
            self.held[slot] = []
        self._scratch(slots)

    @torch.inference_mode()
    def move(self, sources: list[int], targets: list[int]) -> None:
        """Slot sources[i]'s pages to slot targets[i] (read all before writing any): their
        rows of the table move on the device; the sources no target names are left empty."""
        if not sources:
            return
        moving = [self.held[s] for s in sources]
        for source in sources:
            self.held[source] = []
        for target, pages in zip(targets, moving, strict=True):
            self.held[target] = pages
        read = to_device(sources, torch.long, self.device)
        write = to_device(targets, torch.long, self.device)
        self.table.index_copy_(0, write, self.table.index_select(0, read))
        self._scratch(sorted(set(sources) - set(targets)))

    def _scratch(self, slots: list[int]) -> None:
        if slots:
            self.table.index_fill_(0, to_device(slots, torch.long, self.device), SCRATCH)

    def _write_table(self, slots: list[int]) -> None:
        """These consecutive slots' rows of the table, from their pages (scratch past them)."""
        rows = torch.full((len(slots), self.table.shape[1]), SCRATCH, dtype=torch.int32)
        for row, slot in enumerate(slots):
            rows[row, : len(self.held[slot])] = torch.tensor(self.held[slot], dtype=torch.int32)
        self.table[slots[0] : slots[-1] + 1].copy_(to_device(rows, torch.int32, self.device))

    def _pool(self, pages: int) -> None:
        """Pools of `pages` pages (the old ones' contents kept; page 0 scratch)."""
        old = self.pages
        self.pages = [
            tuple(  # type: ignore[misc]
                torch.zeros(pages, PAGE_SIZE, heads, dim, dtype=self.dtype, device=self.device)
                for dim in (key_dim, value_dim)
            )
            for heads, key_dim, value_dim in self.layout
        ]
        held = old[0][0].shape[0] if old else 1  # pages made so far (0 is scratch)
        for (keys, values), (old_keys, old_values) in zip(self.pages, old, strict=False):
            keys[:held].copy_(old_keys)
            values[:held].copy_(old_values)
        self.free += list(range(pages - 1, held - 1, -1))  # popped lowest first

    def _table(self, rows: int, row_pages: int, live: int) -> None:
        old_table, old_write = self.table, self.write_at
        self.table = torch.zeros(rows, row_pages, dtype=torch.int32, device=self.device)
        self.write_at = torch.zeros(rows, dtype=torch.long, device=self.device)
        self.table[:live, : old_table.shape[1]].copy_(old_table[:live])
        self.write_at[:live].copy_(old_write[:live])
        self.held += [[] for _ in range(rows - len(self.held))]


def pool_pages(cache_tokens: int | None, rows: int, ends: list[int]) -> int:
    """The pages a pool is made with: the budget's (each row's last page partly used, and the
    scratch page), else twice what the first rows need."""
    if cache_tokens is not None:
        return pages_for(cache_tokens) + rows + 1
    return 2 * sum(pages_for(end) for end in ends) + 1
