"""Qwen3 dense (and Qwen2): Llama's layer with q/k norms (Qwen3) or q/k/v biases (Qwen2)."""

from queue_tinker.workers.model.families.family import Family

FAMILY = Family(
    name="Qwen3",
    model_types=frozenset({"qwen2", "qwen3"}),
    shards=True,
    fused_kernels=True,
    builtins=("queue-tinker/tiny-qwen3",),
)
