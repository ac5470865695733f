"""The fit planner's tables in docs/operations.md: four published model shapes on 1, 2, 4 and 8
GPUs of 80 GiB, and the largest families Tinker's users train (Qwen3-30B-A3B, gpt-oss-120b,
Kimi-K2) on 1, 2, 4 and 8 H200s with what beyond today's workers would fit them; at the
service's default settings (no weights: configs from their published values, the model built
on the meta device).

    .venv/bin/python -m bench.fit_table            # prints the tables
    .venv/bin/python -m bench.fit_table --write    # and puts them in docs/operations.md

tests/workers/model/test_fit.py checks each row of the docs against a fresh plan.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import cache
from pathlib import Path

from transformers import (
    DeepseekV3Config,
    GptOssConfig,
    LlamaConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3MoeConfig,
)

from bench.harness.report import write_between
from queue_tinker.config.engine import EngineConfig
from queue_tinker.workers.model.fit import (
    FitPlan,
    FitSettings,
    ModelShape,
    beyond_workers,
    gib,
    model_shape,
)
from queue_tinker.workers.model.fit import plan_fit as plan_fit_for

DOCS = Path(__file__).resolve().parents[1] / "docs" / "operations.md"
BEGIN = "<!-- fit table: python -m bench.fit_table --write -->"
END = "<!-- end of fit table -->"
H200_BEGIN = "<!-- H200 fit table: python -m bench.fit_table --write -->"
H200_END = "<!-- end of H200 fit table -->"
GPU_BYTES = 80 << 30
H200_BYTES = 143_771 << 20  # what nvidia-smi reports as an H200's (141 GB) total
GPU_COUNTS = (1, 2, 4, 8)
BF16_BYTES = 2  # QT_DTYPE=auto on CUDA


def qwen3_30b_a3b() -> Qwen3MoeConfig:
    config = Qwen3MoeConfig(
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        vocab_size=151936,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
    )
    # Published, but not in the signature transformers declares: 128, not 2048 / 32 heads.
    config.head_dim = 128
    return config


# The published config.json values that set their sizes (rope and token ids change nothing).
MODELS: dict[str, Callable[[], PretrainedConfig]] = {
    "Llama-3.1-8B": lambda: LlamaConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
    ),
    "Qwen2.5-32B": lambda: Qwen2Config(
        hidden_size=5120,
        intermediate_size=27648,
        num_hidden_layers=64,
        num_attention_heads=40,
        num_key_value_heads=8,
        vocab_size=152064,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
    ),
    "Llama-3.1-70B": lambda: LlamaConfig(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
    ),
    "Qwen3-30B-A3B": qwen3_30b_a3b,
    # MXFP4 experts on disk, dequantized to bf16 on load: planned in bf16. Alternate layers
    # attend within 128 tokens; the KV cache is planned at full length on every layer.
    "gpt-oss-120b": lambda: GptOssConfig(
        hidden_size=2880,
        intermediate_size=2880,
        num_hidden_layers=36,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        num_local_experts=128,
        num_experts_per_tok=4,
        sliding_window=128,
        vocab_size=201088,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
    ),
    # DeepSeek-V3's architecture (latent attention, 1 shared + 384 routed experts).
    "Kimi-K2": lambda: DeepseekV3Config(
        hidden_size=7168,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        num_hidden_layers=61,
        num_attention_heads=64,
        num_key_value_heads=64,
        n_shared_experts=1,
        n_routed_experts=384,
        num_experts_per_tok=8,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        kv_lora_rank=512,
        q_lora_rank=1536,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        vocab_size=163840,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
    ),
}
# The models of each table.
MODELS_80GIB = ("Llama-3.1-8B", "Qwen2.5-32B", "Llama-3.1-70B", "Qwen3-30B-A3B")
MODELS_H200 = ("Qwen3-30B-A3B", "gpt-oss-120b", "Kimi-K2")


@cache
def shape_of(model: str) -> ModelShape:
    return model_shape(MODELS[model]())


def settings() -> FitSettings:
    return FitSettings.of(EngineConfig())  # the settings' own defaults, whatever QT_* says


def plan_for(model: str, gpus: int, gpu_bytes: int = GPU_BYTES) -> FitPlan:
    config = MODELS[model]()
    return plan_fit_for(config, BF16_BYTES, gpus, gpu_bytes, settings(), shape_of(model))


HEADER = (
    "| model | GPUs | fits | weights | adapters | activations (layers checkpointed) "
    "| KV cache | headroom | needed | any one of these fits |\n"
    "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"
)
H200_HEADER = (
    "| model | H200s | fits | weights | adapters (each) | activations (layers checkpointed) "
    "| KV cache | headroom | needed | any one of these fits | beyond today's workers |\n"
    "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |"
)


def row(model: str, gpus: int) -> str:
    """One line of the 80 GiB table: GiB per GPU, two decimals."""
    plan = plan_for(model, gpus)
    return "| " + " | ".join(_cells(model, gpus, plan, gib(plan.adapters))) + " |"


def h200_row(model: str, gpus: int) -> str:
    """One line of the H200 table: as row's, each adapter's share too, and where no setting
    fits the plan, what beyond today's workers would (beyond_workers)."""
    plan = plan_for(model, gpus, H200_BYTES)
    adapters = f"{gib(plan.adapters)} ({gib(plan.adapter_each)})"
    beyond = ""
    if not plan.fits and not plan.remedies:
        config = MODELS[model]()
        ways = beyond_workers(config, BF16_BYTES, gpus, H200_BYTES, settings(), shape_of(model))
        beyond = "; ".join(ways) or "none tried"
    return "| " + " | ".join((*_cells(model, gpus, plan, adapters), beyond)) + " |"


def _cells(model: str, gpus: int, plan: FitPlan, adapters: str) -> tuple[str, ...]:
    whole, selective = plan.recomputation.whole, plan.recomputation.selective
    layers = f"{whole}+{selective}s/{plan.layers}" if selective else f"{whole}/{plan.layers}"
    activations = f"{gib(plan.activations)} ({layers})"
    changes = "" if plan.fits else ("; ".join(plan.remedies) or "no single change")
    return (
        model, str(gpus), "yes" if plan.fits else "**no**", gib(plan.weights), adapters,
        activations, gib(plan.kv_cache), gib(plan.headroom), gib(plan.needed), changes,
    )  # fmt: skip


def table() -> str:
    return "\n".join([HEADER, *(row(m, g) for m in MODELS_80GIB for g in GPU_COUNTS)])


def h200_table() -> str:
    return "\n".join([H200_HEADER, *(h200_row(m, g) for m in MODELS_H200 for g in GPU_COUNTS)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="put the table in the docs")
    args = parser.parse_args()
    text, h200 = table(), h200_table()
    print(text, h200, sep="\n\n")
    if args.write:
        write_between(DOCS, DOCS.read_text(), BEGIN, END, text)
        write_between(DOCS, DOCS.read_text(), H200_BEGIN, H200_END, h200)


if __name__ == "__main__":
    main()
