"""Qwen3-MoE (and Qwen2-MoE): routed experts in stacked 3-D weights (transformers 5), a shared
expert's plain MLP in Qwen2-MoE."""

from queue_tinker.workers.model.families.family import Family

FAMILY = Family(
    name="Qwen3-MoE",
    model_types=frozenset({"qwen3_moe", "qwen2_moe"}),
    experts=True,
    fused_kernels=True,
    builtins=("queue-tinker/tiny-moe",),
)
