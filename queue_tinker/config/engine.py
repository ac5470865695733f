"""The LoRA engine's settings: what a worker's engine reads (workers/executor/lora.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from queue_tinker.config.limits import LimitsConfig


class EngineConfig(LimitsConfig):
    """The LoRA engine on a worker: resident adapters, snapshots, the training pass and the
    sampler's budgets, dtypes and kernels; the request limits it checks again."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_resident_adapters: int | None = Field(
        default=None,
        ge=1,
        description="LoRA adapters a worker keeps in memory; beyond this the least recently "
        "used one is written to checkpoint storage and restored on its next op. Unset: as many "
        "as the GPU holds beside the model and its budgets (the fit planner), at most "
        "32; 32 on the CPU. Set, a worker whose GPU cannot hold them refuses to start.",
    )
    snapshot_every_steps: int = Field(
        default=20,
        ge=1,
        description="A worker writes a model's state to storage every this many optimizer "
        "steps (and on eviction or hand-over); the model's op log is trimmed up to it.",
    )
    sample_batch_sequences: int | None = Field(
        default=None,
        ge=1,
        description="Most sequences a worker generates in one batch; concurrent sample "
        "requests beyond it run in the next batch. Bounds KV-cache memory. Unset: 64 on the "
        "CPU; on CUDA, what the device's free memory holds at start-up (4K-token sequences).",
    )
    sample_cache_tokens: int | None = Field(
        default=None,
        ge=1,
        description="Most KV-cache tokens (sequences x positions) a worker's sampling batch may "
        "come to hold: a sample joins the batch only if, with every sequence in it running to "
        "its max_tokens, the cache stays within this; the rest wait for sequences to finish "
        "(one sample that alone needs more runs alone). Unset: no cap on the CPU; on CUDA, "
        "what the device's free memory holds at start-up.",
    )
    cross_adapter_batch: bool = Field(
        default=True,
        description="Whether a worker runs the forward / forward_backward ops of different "
        "models (LoRA adapters on its base model) together, in one model pass with each row "
        "on its own adapter, and their optim_steps in the same batch; results equal running "
        "them one at a time. Off (0): training ops run one at a time.",
    )
    train_batch_tokens: int | None = Field(
        default=None,
        ge=1,
        description="Most padded tokens (rows x longest row) in one shared training pass of a "
        "cross-adapter batch; ops beyond it go in the next pass (one op always runs, however "
        "big). Bounds activation memory. Unset: 32768 on the CPU; on CUDA, what the device's "
        "free memory holds at start-up. A pass that runs out of memory anyway is split in "
        "halves and retried.",
    )
    dtype: Literal["auto", "bf16", "fp32"] = Field(
        default="auto",
        description="The base model's compute dtype on workers: auto is bf16 on CUDA and fp32 "
        "on the CPU. LoRA weights, their gradients, AdamW moments and checkpoints stay fp32 "
        "either way.",
    )
    liger_kernels: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="Put liger-kernel's Triton RMSNorm, RoPE and SwiGLU in the base model "
        "(the gpu extra; CUDA only; not in worker groups). auto: on CUDA where liger is "
        "installed, a worker alone; on: a worker that cannot refuses to start; off: never. "
        "bench.mfu measured 1.19x the training pass at the Llama-3.1-8B shape on an H100 and "
        "1.17x on an H200, where the GPU suite holds them to the eager model.",
    )
    decode_step: Literal["auto", "padded", "slots", "graphs"] = Field(
        default="padded",
        description="How the sampler runs a decode step. padded: the rows' KV cache "
        "left-padded to the longest row, an eager step. slots: every row in a fixed KV slot "
        "and the rows' adapters in fixed LoRA slots, one fixed sequence of kernels whatever "
        "the mix of adapters (eager). graphs: slots, each batch bucket's step captured as a "
        "CUDA graph and replayed (CUDA only; elsewhere as slots). auto: graphs on CUDA, padded "
        "on the CPU. Worker groups and models the slots do not fit (sliding-window attention, "
        "vision, mixtures of experts' LoRA) run padded. padded by default until the GPU test "
        "suite has run a worker with graphs.",
    )
    lora_matmul_dtype: Literal["auto", "fp32"] = Field(
        default="auto",
        description="The dtype of LoRA's matmuls in training and sampling passes. auto: the "
        "base model's (bf16 on CUDA; fp32 on the CPU), the adapters' fp32 weights cast per "
        "call: LoRA at the base's speed, and no fp32 copy of each LoRA input kept for "
        "backward. fp32: in the adapters' fp32, the input cast up. Weights, gradients, AdamW "
        "moments and checkpoints are fp32 either way.",
    )
    device_memory_gib: float | None = Field(
        default=None,
        gt=0,
        description="The GiB of its CUDA device a worker plans for and may take: the fit "
        "check, the budgets and what a pass borrows read the device as this big at most, and "
        "torch's allocator is held to it. For a GPU shared with other processes, or to measure "
        "a smaller card's plan on a bigger one (bench.mfu --memory-gib 80 on an H200). Unset: "
        "the whole device.",
    )
    lora_form: Literal["auto", "blocks", "stacked", "grouped"] = Field(
        default="auto",
        description="How a training pass of several adapters' ops runs their LoRA. grouped: "
        "two grouped matmuls a LoRA linear over stacks that are the adapters' weights, "
        "whatever the adapters; stacked: two matmuls a linear over every adapter's columns; "
        "blocks: two matmuls an adapter and linear. auto: grouped wherever the pass allows "
        "it (plain LoRA, one rank a layer among its adapters), else stacked on CUDA and "
        "blocks on the CPU. A form a pass does not allow gives way to auto's choice.",
    )
    activation_checkpointing: Literal["auto", "on", "selective", "off"] = Field(
        default="auto",
        description="Whether a training pass keeps only each decoder layer's input and "
        "recomputes the layer in backward (on: less memory, one more forward of time; equal "
        "results), or keeps its GEMMs' and attention's outputs and recomputes only the "
        "elementwise work between them (selective: about half a layer's memory for a few "
        "percent of its time). auto: on CUDA, the fewest whole layers, then the fewest "
        "selective ones, that keep each pass's activations within the training budget from "
        "free memory (none when the pass fits); on the CPU, every layer for passes of at "
        "least activation_checkpointing_tokens padded tokens.",
    )
    activation_checkpointing_tokens: int = Field(
        default=4_096,
        ge=1,
        description="The padded tokens of a training pass from which auto activation "
        "checkpointing turns on where no memory budget is known (the CPU).",
    )
    logit_chunk_elements: int = Field(
        default=1 << 27,
        ge=1,
        description="Logits (rows x positions x vocabulary) a training pass computes at once "
        "on its way to each target's log-probability: 2^27 fp32 elements are 512 MiB, 1,046 "
        "positions of a 128k vocabulary. Smaller bounds the pass's peak memory; larger takes "
        "fewer unembedding calls (each chunk a few dozen kernels).",
    )
    pack_above_padding: float = Field(
        default=0.5,
        ge=0,
        le=1,
        description="A training pass packs several datums into one row once one datum a row "
        "would leave more than this fraction of the pass padding (0: always; 1: never). Below it "
        "packing saves less than it costs: its block-diagonal mask takes attention off the "
        "kernels that need no mask.",
    )
