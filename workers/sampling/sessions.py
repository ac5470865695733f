"""Sampling on the worker: sampling sessions, the weights they sample from, and the decode
loop their sample ops share.

A sampling session is a queue of sample ops bound to one set of weights: the base model or a
checkpoint (tinker://<run>/sampler_weights/<name>, or .../weights/<name>). Sampling has no
state to recover, so a session's ops are durable as soon as they ran and are never replayed.

Sample ops are not run one call each: the worker hands them over (`join`) and then calls `step`,
one scheduling quantum of the decode loop (workers/sampling/decode_loop.py) at a time, which
hands back the ops that finished in it. Between quanta the worker runs other models' ops.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from queue_tinker.config.engine import EngineConfig
from queue_tinker.errors import OpCancelledError, UserInputError
from queue_tinker.storage.base import CheckpointStore
from queue_tinker.types import codec
from queue_tinker.types.model_names import check_served_name
from queue_tinker.types.requests.loss_inputs import ModelLimits
from queue_tinker.types.requests.request_limits import (
    RequestLimits,
    check_request_bytes,
)
from queue_tinker.types.requests.sampling import (
    CreateSamplingSessionInput,
    SampleInput,
    SampleResponse,
    check_sample,
    check_sample_size,
    max_new_tokens,
)
from queue_tinker.types.service.checkpoints import CheckpointPath, loadable
from queue_tinker.types.service.ops import Op
from queue_tinker.workers.interface import OpResult, ResultOrError, parse_body
from queue_tinker.workers.model.adapters import AdapterPool
from queue_tinker.workers.model.checkpoints import checkpoint_key, read_meta
from queue_tinker.workers.model.memory import Budgets, kv_bytes_per_token, row_state_bytes
from queue_tinker.workers.model.vision_language import ImageSupport
from queue_tinker.workers.sampling.decode_loop import DecodeLoop, GenerationRequest, Key
from queue_tinker.workers.sampling.slot_decode import PADDED, StepKind

log = logging.getLogger(__name__)

DEFAULT_SAMPLE_BATCH_SEQUENCES = 64  # QT_SAMPLE_BATCH_SEQUENCES unset, off CUDA


@dataclass
class _Joined:
    """A sample op in the decode loop."""

    op: Op
    directory: Path | None  # the checkpoint it samples from (kept resident meanwhile)
    prompt_tokens: int
    follows: str | None  # the training run whose inflight weights it follows
    peak_rows: int = 0  # the most rows the loop held while it ran


@dataclass
class _Waiting:
    """A sample op joined but not in the loop yet: its checkpoint waits for room."""

    op: Op
    request: GenerationRequest
    directory: Path | None
    follows: str | None


# Whether a decode quantum begun at `began` (perf_counter) with `budget_s` is over. A worker
# group's ranks take rank 0's answer (workers/group/), so all of them take the same steps.
QuantumOver = Callable[[float, float], bool]


def time_is_up(began: float, budget_s: float) -> bool:
    return time.perf_counter() - began >= budget_s


class SamplingSessions:
    def __init__(
        self,
        config: EngineConfig,
        pool: AdapterPool,
        store: CheckpointStore,
        base_model: str,
        limits: ModelLimits,
        device: torch.device,
        tokenizer: Callable[[], Any],
        budgets: Budgets | None = None,
        images: ImageSupport | None = None,
        quantum_over: QuantumOver | None = None,
        decode_step: StepKind = PADDED,
    ) -> None:
        """`config`: the engine's settings (the request limits, the decode loop's rows and KV
        tokens, each unset one taken from the device's `budgets`, or the CPU's default)."""
        self.pool = pool
        self.decode_step = decode_step  # how the decode loop runs its steps (slot_decode.py)
        self.quantum_over = quantum_over or time_is_up
        self.store = store
        self.base_model = base_model
        self.limits = limits
        self.device = device
        self._tokenizer = tokenizer  # loaded on the first sample: training needs none
        self.max_batch_sequences = config.sample_batch_sequences or (
            budgets.sample_batch_sequences if budgets else DEFAULT_SAMPLE_BATCH_SEQUENCES
        )
        # The decode loop's KV-cache budget (None: no cap).
        self.max_cache_tokens = config.sample_cache_tokens or (
            budgets.sample_cache_tokens if budgets else None
        )
        self.request_limits = RequestLimits.of(config)
        self.images = images or ImageSupport(base_model)  # a prompt's image chunks
        self.sessions: dict[str, int] = {}  # sampling session -> last seq run here
        self._loop: DecodeLoop | None = None
        # Ops joined but not in the loop yet (their checkpoint waits for room), ops in the
        # loop (by job id), and outcomes the next step hands back.
        self._waiting: deque[_Waiting] = deque()
        self._joined: dict[str, _Joined] = {}
        self._finished: list[tuple[Op, ResultOrError]] = []
        self._in_use: Counter[Path] = Counter()  # checkpoint -> ops in the loop on it

    def owns(self, model_id: str) -> bool:
        return model_id in self.sessions

    def durable_seq(self, model_id: str) -> int | None:
        """All a session ran is durable: it has no state to replay."""
        return self.sessions.get(model_id)

    def drop(self, model_id: str) -> None:
        """Forget a session: its ops in the loop, and the session itself."""
        self.cancel(model_id)
        self.sessions.pop(model_id, None)

    def create_session(self, op: Op) -> OpResult:
        """Check the session's weights now, so a bad path fails the create, not every sample."""
        body = parse_body(CreateSamplingSessionInput, op.payload)
        check_served_name(body.base_model, self.base_model, self.limits.context_length)
        if body.model_path is not None:
            directory = self._weights(body.model_path, tenant_id=body.tenant_id)
            if self._has_room(directory):  # else it loads when its first sample joins
                self._load(directory)
        self.sessions[op.model_id] = op.seq
        return OpResult(result=codec.encode({"sampler_id": op.model_id}))

    # --- the decode loop: ops join, step, leave ---------------------------------------------
    def join(self, ops: Sequence[Op]) -> None:
        """Hand sample ops to the decode loop; they join it at the next step with room for them.
        An op with bad input fails at once: its error comes out of the next step."""
        for op in ops:
            self.sessions[op.model_id] = max(op.seq, self.sessions.get(op.model_id, 0))
            try:
                self._waiting.append(self._request(op))
            except Exception as exc:  # reported as this op's failure
                self._finished.append((op, exc))

    def stepping(self) -> bool:
        """Whether joined ops are unfinished, or finished and not handed back yet."""
        return bool(self._waiting or self._joined or self._finished)

    def step(self, budget_s: float) -> list[tuple[Op, ResultOrError]]:
        """One quantum: decode steps until a request finishes or `budget_s` has passed (at
        least one step); the ops that finished, with their results or errors."""
        self._enter_loop()
        began = time.perf_counter()
        while self._joined and not self._finished:
            loop = self._loop_of()
            try:
                done = loop.step(self.pool.model, self.pool.lora_layers(), self.pool.lora_compute)
            except Exception as exc:  # the step itself failed: so does every op in the loop
                log.exception("a decode step of %d rows failed", loop.rows)
                for key in loop.clear():
                    joined = self._joined.pop(str(key))
                    self._release(joined.directory)
                    self._finished.append((joined.op, exc))
                break
            for joined in self._joined.values():
                joined.peak_rows = max(joined.peak_rows, loop.step_rows)
            self._finished += [
                self._result(str(key), response, loop.finished_prefilled.get(key, 0))
                for key, response in done
            ]
            if self.quantum_over(began, budget_s):
                break
        finished, self._finished = self._finished, []
        return finished

    def stop(self, reasons: Mapping[str, str]) -> None:
        """Stop joined ops (job id -> why): their rows leave the decode loop now, between two
        steps, and each comes out of the next step failed with OpCancelledError(why). The
        other rows keep their cache and their random streams, so they go on exactly as if
        the stopped ones had never been there."""
        keys = {key for key in self._joined if key in reasons}
        if keys:
            self._loop_of().cancel(keys)
        for key in keys:
            joined = self._joined.pop(key)
            self._release(joined.directory)
            self._finished.append((joined.op, OpCancelledError(reasons[key])))
        waiting = [w.op for w in self._waiting if w.op.job_id in reasons]
        self._waiting = deque(w for w in self._waiting if w.op.job_id not in reasons)
        self._finished += [(op, OpCancelledError(reasons[op.job_id])) for op in waiting]

    def cancel(self, model_id: str) -> None:
        """Forget a model's joined ops (its lease is gone: their results could not be
        published)."""
        keys = {key for key, joined in self._joined.items() if joined.op.model_id == model_id}
        if keys:
            self._loop_of().cancel(keys)
        for key in keys:
            self._release(self._joined.pop(key).directory)
        self._waiting = deque(w for w in self._waiting if w.op.model_id != model_id)
        self._finished = [f for f in self._finished if f[0].model_id != model_id]

    def _enter_loop(self) -> None:
        """Waiting ops join the loop, first come first served, while the checkpoints they
        sample from fit among the resident sampler adapters beside every one in use."""
        while self._waiting:
            waiting = self._waiting[0]
            op, request, directory = waiting.op, waiting.request, waiting.directory
            if directory is not None and not self._has_room(directory):
                return  # it waits for an op on another checkpoint to finish
            self._waiting.popleft()
            try:
                adapter = self._load(directory) if directory is not None else None
            except Exception as exc:
                log.exception("loading the sampler weights %s failed", directory)
                self._finished.append((op, exc))
                continue
            if directory is not None:
                self._in_use[directory] += 1
            self._joined[op.job_id] = _Joined(op, directory, len(request.prompt), waiting.follows)
            self._loop_of().add(op.job_id, replace(request, adapter=adapter))

    # --- inflight weights (queue/ops/inflight.py) -----------------------------------------------
    def followed(self) -> set[str]:
        """The training runs whose inflight weights joined ops follow."""
        joined = {j.follows for j in self._joined.values()}
        return {run for run in joined | {w.follows for w in self._waiting} if run is not None}

    def follow(self, newest: Mapping[str, str]) -> None:
        """The newest inflight weights of runs that joined ops follow (run -> tinker path).
        Waiting ops join on them; ops in the loop move to them at their next decode step,
        keeping their KV cache. Weights that cannot be read, or have no room among the
        resident sampler adapters yet, leave the ops where they are until the next call."""
        directories: dict[str, Path] = {}
        for run, path in newest.items():
            try:
                directories[run] = self._weights(path)
            except Exception:
                log.exception("inflight weights %s of %s cannot be read; not followed", path, run)
        for waiting in self._waiting:
            if waiting.follows in directories:
                waiting.directory = directories[waiting.follows]
        moves: dict[Key, str | None] = {}
        for key, joined in self._joined.items():
            directory = directories.get(joined.follows or "")
            if directory is None or directory == joined.directory:
                continue
            if not self._has_room(directory):
                continue
            moves[key] = self._load(directory)
            self._in_use[directory] += 1
            self._release(joined.directory)
            joined.directory = directory
        if moves:
            self._loop_of().retarget(moves)

    def _has_room(self, directory: Path) -> bool:
        return directory in self._in_use or len(self._in_use) < self.pool.max_resident

    def _load(self, directory: Path) -> str:
        """The checkpoint's adapter name, loaded if it is not. Loading may evict the least
        recently used sampler adapter, so the ones in use are touched first."""
        for used in self._in_use:
            self.pool.sampler(used)
        return self.pool.sampler(directory)

    def _result(self, key: str, response: SampleResponse, prefilled: int) -> tuple[Op, OpResult]:
        joined = self._joined.pop(key)
        self._release(joined.directory)
        generated = sum(len(s.tokens) for s in response.sequences)
        # batch_sequences: the most sequences that shared the decode loop with this request;
        # prompt_tokens_prefilled: its prompt tokens run through the model (0 when it joined
        # from an identical prompt's prefill; never twice, inflight weights moving or not).
        return joined.op, OpResult(
            result=codec.encode(response.model_dump()),
            metrics={
                "tokens_generated:sum": float(generated),
                "batch_sequences:max": float(joined.peak_rows),
                "prompt_tokens_prefilled:sum": float(prefilled),
            },
            tokens=joined.prompt_tokens + generated,
        )

    def _release(self, directory: Path | None) -> None:
        if directory is not None:
            self._in_use[directory] -= 1
            if self._in_use[directory] <= 0:
                del self._in_use[directory]

    def _loop_of(self) -> DecodeLoop:
        """The decode loop, made on first use (the tokenizer it needs is loaded then)."""
        if self._loop is None:
            tokenizer = self._tokenizer()
            self._loop = DecodeLoop(
                self.device,
                eos_token_ids(self.pool.base, tokenizer),
                lambda tokens: str(tokenizer.decode(tokens)),
                max_rows=self.max_batch_sequences,
                max_cache_tokens=self.max_cache_tokens,
                row_cache_tokens=row_cache_tokens(self.pool.base),
                slots=self.decode_step.slots,
                graphs=self.decode_step.graphs,
            )
        return self._loop

    def _request(self, op: Op) -> _Waiting:
        """The op as a generation request (adapter not yet resolved) with its weights."""
        check_request_bytes(len(op.payload), self.request_limits)  # before decoding it
        body = parse_body(SampleInput, op.payload)
        check_sample_size(body, self.request_limits)
        expanded = self.images.expand("prompt", body.prompt)
        if expanded.images is not None:  # again, with its images' tokens counted
            body = body.model_copy(update={"prompt": expanded.model_input})
            check_sample_size(body, self.request_limits)
        limits = self.limits.with_cap(body.context_cap)
        check_sample(body, limits)
        directory = self._weights(body.model_path) if body.model_path is not None else None
        assert limits.context_length is not None
        request = GenerationRequest(
            prompt=expanded.images.ids if expanded.images else body.prompt.to_ints(),
            num_samples=body.num_samples,
            params=body.sampling_params,
            max_tokens=max_new_tokens(body, limits.context_length),
            prompt_logprobs=body.prompt_logprobs,
            adapter=None,
            prompt_topk=body.topk_prompt_logprobs,
            prompt_targets=body.target_prompt_logprobs,
            prompt_alt_k=body.prompt_alt_tokens_k,
            sample_topk=body.topk_sample_logprobs,
            images=expanded.images,
        )
        return _Waiting(op, request, directory, body.inflight_of)

    def _weights(self, model_path: str, tenant_id: str | None = None) -> Path:
        """The checkpoint directory behind a model_path; another tenant's checkpoint is reported
        exactly like a missing one, unless it is published."""
        path = loadable(CheckpointPath.parse(model_path, "model_path"), "model_path")
        # A local directory holding the checkpoint: itself, or a cached copy of a remote one.
        directory = self.store.fetch(checkpoint_key(path))
        meta = read_meta(directory) if directory is not None else None
        if (
            directory is None
            or meta is None
            or (tenant_id is not None and meta.tenant_id != tenant_id and not meta.public)
        ):
            raise UserInputError(
                f"model_path: no checkpoint {model_path} (unknown, expired or deleted)"
            )
        if meta.base_model != self.base_model:
            raise UserInputError(
                f"model_path: {model_path} was trained on {meta.base_model}; this sampler's base "
                f"model is {self.base_model}"
            )
        return directory


def eos_token_ids(model: torch.nn.Module, tokenizer: Any) -> list[int]:
    """What ends a sequence when the request names no stop: the tokenizer's EOS and any the
    model's generation config adds (several for chat models)."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    config = getattr(model, "generation_config", None)
    configured = getattr(config, "eos_token_id", None)
    if isinstance(configured, int):
        ids.add(configured)
    elif isinstance(configured, list):
        ids.update(int(i) for i in configured)
    return sorted(ids)


def row_cache_tokens(model: torch.nn.Module) -> int:
    """The cache tokens' worth a row of this model holds whatever its length (its sliding
    windows, its linear-attention states), in its own dtype: what the decode loop charges each
    row beside its columns."""
    if not isinstance(model, PreTrainedModel):
        return 0  # no config to read it from
    config = model.config.get_text_config()
    itemsize = model.dtype.itemsize
    return math.ceil(row_state_bytes(config, itemsize) / kv_bytes_per_token(config, itemsize))
