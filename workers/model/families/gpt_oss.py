"""gpt-oss: attention with sinks, sliding-window layers alternating with full ones, experts
only in every MLP (its clamped SwiGLU is its own: no fused kernel of liger's applies)."""

from queue_tinker.workers.model.families.family import Family

FAMILY = Family(
    name="gpt-oss",
    model_types=frozenset({"gpt_oss"}),
    mlp=(),
    experts=True,
    builtins=("queue-tinker/tiny-gpt-oss",),
)
