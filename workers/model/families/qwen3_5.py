"""Qwen3.5: three gated-delta-net (linear attention) layers to one of full attention; the
linear layers' projections count as attention, as the full layers' do."""

from queue_tinker.workers.model.families.family import ATTENTION, Family

LINEAR_ATTENTION = ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj")

FAMILY = Family(
    name="Qwen3.5",
    model_types=frozenset({"qwen3_5", "qwen3_5_text"}),
    attention=(*ATTENTION, *LINEAR_ATTENTION),
    builtins=("queue-tinker/tiny-qwen3.5",),
)
