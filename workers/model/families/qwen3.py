"""Qwen3 dense (and Qwen2): Llama's layer with q/k norms (Qwen3) or q/k/v biases (Qwen2). Both
decode in Llama's fused step: Qwen3 with each head's q and k normed before rotary, Qwen2 with
the biases added by its q/k/v GEMM."""

from transformers import PreTrainedModel

from queue_tinker.workers.model.families.family import Family
from queue_tinker.workers.model.families.fused_decode import FusedDecoder
from queue_tinker.workers.model.families.llama import LlamaDecoder


class Qwen3Decoder(LlamaDecoder):
    """Llama's fused step with Qwen3's q / k norms (rope_kv_write norms each head first)."""

    MODEL_TYPES = frozenset({"qwen3"})
    QK_NORM = True


class Qwen2Decoder(LlamaDecoder):
    """Llama's fused step with Qwen2's q/k/v biases (one fused bias on the q/k/v GEMM)."""

    MODEL_TYPES = frozenset({"qwen2"})
    QKV_BIAS = True


def decoder_of(model: PreTrainedModel) -> FusedDecoder | None:
    """Qwen3's or Qwen2's fused step, whichever the model is (None where neither fits)."""
    return Qwen3Decoder.of(model) or Qwen2Decoder.of(model)


FAMILY = Family(
    name="Qwen3",
    model_types=frozenset({"qwen2", "qwen3"}),
    shards=True,
    fused_kernels=True,
    builtins=("queue-tinker/tiny-qwen3",),
    decoder=decoder_of,
)
