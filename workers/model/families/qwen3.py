"""Qwen3 dense (and Qwen2): Llama's layer with q/k norms (Qwen3) or q/k/v biases (Qwen2). Qwen3
decodes in Llama's fused step with each head's q and k normed before rotary; Qwen2's biases
keep it on transformers' layers."""

from queue_tinker.workers.model.families.family import Family
from queue_tinker.workers.model.families.llama import LlamaDecoder


class Qwen3Decoder(LlamaDecoder):
    """Llama's fused step with Qwen3's q / k norms (rope_kv_write norms each head first)."""

    MODEL_TYPES = frozenset({"qwen3"})
    QK_NORM = True


FAMILY = Family(
    name="Qwen3",
    model_types=frozenset({"qwen2", "qwen3"}),
    shards=True,
    fused_kernels=True,
    builtins=("queue-tinker/tiny-qwen3",),
    decoder=Qwen3Decoder.of,
)
