"""Any other architecture transformers loads: the names the families use, and those of
GPT-2, GPT-NeoX and Phi-style layers, matched against what the model has. No worker group
splits it; liger's kernels apply where liger knows its model_type."""

from queue_tinker.workers.model.families import deepseek_v3, qwen3_5
from queue_tinker.workers.model.families.family import MLP, Family

FAMILY = Family(
    name="another architecture",
    model_types=frozenset(),
    attention=tuple(
        dict.fromkeys(
            (
                *deepseek_v3.FAMILY.attention,
                *qwen3_5.FAMILY.attention,
                "qkv_proj",
                "query_key_value",
                "c_attn",
                "dense",
            )
        )
    ),
    mlp=(*MLP, "gate_up_proj", "dense_h_to_4h", "dense_4h_to_h", "c_fc", "c_proj", "fc1", "fc2"),
    experts=True,
    # A vision tower under the name most vision-language models give it.
    frozen=("visual",),
    fused_kernels=True,
)
