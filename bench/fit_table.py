"""The fit planner's table in docs/operations.md: four published model shapes on 1, 2, 4 and 8
GPUs of 80 GiB, at the service's default settings (no weights: configs from their published
values, the model built on the meta device).

    .venv/bin/python -m bench.fit_table            # prints the table
    .venv/bin/python -m bench.fit_table --write    # and puts it in docs/operations.md

tests/workers/model/test_fit.py checks each row of the docs against a fresh plan.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import cache
from pathlib import Path

from transformers import LlamaConfig, PretrainedConfig, Qwen2Config, Qwen3MoeConfig

from bench.harness.report import write_between
from queue_tinker.config.engine import EngineConfig
from queue_tinker.workers.model.fit import FitPlan, FitSettings, ModelShape, gib, model_shape
from queue_tinker.workers.model.fit import plan_fit as plan_fit_for

DOCS = Path(__file__).resolve().parents[1] / "docs" / "operations.md"
BEGIN = "<!-- fit table: python -m bench.fit_table --write -->"
END = "<!-- end of fit table -->"
GPU_BYTES = 80 << 30
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
}


@cache
def shape_of(model: str) -> ModelShape:
    return model_shape(MODELS[model]())


def plan_for(model: str, gpus: int) -> FitPlan:
    config = MODELS[model]()
    settings = FitSettings.of(EngineConfig())  # the settings' own defaults, whatever QT_* says
    return plan_fit_for(config, BF16_BYTES, gpus, GPU_BYTES, settings, shape_of(model))


HEADER = (
    "| model | GPUs | fits | weights | adapters | activations (layers checkpointed) "
    "| KV cache | headroom | needed | any one of these fits |\n"
    "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"
)


def row(model: str, gpus: int) -> str:
    """One line of the table: GiB per GPU, two decimals."""
    plan = plan_for(model, gpus)
    activations = f"{gib(plan.activations)} ({plan.checkpointed_layers}/{plan.layers})"
    changes = "" if plan.fits else ("; ".join(plan.remedies) or "no single change")
    cells = (
        model, str(gpus), "yes" if plan.fits else "**no**", gib(plan.weights), gib(plan.adapters),
        activations, gib(plan.kv_cache), gib(plan.headroom), gib(plan.needed), changes,
    )  # fmt: skip
    return "| " + " | ".join(cells) + " |"


def table() -> str:
    return "\n".join([HEADER, *(row(m, g) for m in MODELS for g in GPU_COUNTS)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="put the table in the docs")
    args = parser.parse_args()
    text = table()
    print(text)
    if args.write:
        write_between(DOCS, DOCS.read_text(), BEGIN, END, text)


if __name__ == "__main__":
    main()
