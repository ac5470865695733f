"""Llama 3 (and Mistral, the same layer): the family the others are measured against."""

from queue_tinker.workers.model.families.family import Family

FAMILY = Family(
    name="Llama 3",
    model_types=frozenset({"llama", "mistral"}),
    shards=True,
    fused_kernels=True,
    builtins=("queue-tinker/tiny-llama", "queue-tinker/llama-100m"),
)
