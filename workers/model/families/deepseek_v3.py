"""DeepSeek-V3 (Kimi-K2 is its architecture): multi-head latent attention, whose queries and
keys / values go through low-rank projections (a model without q_lora_rank has a plain q_proj),
the first layers dense, then a shared expert beside the routed ones in every MLP."""

from queue_tinker.workers.model.families.family import Family

FAMILY = Family(
    name="DeepSeek-V3",
    model_types=frozenset({"deepseek_v3"}),
    attention=("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"),
    experts=True,
    builtins=("queue-tinker/tiny-deepseek-v3",),
)
