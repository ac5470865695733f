"""Base model names with a context cap, as Tinker writes them: `Base:peft:<tokens>`.

`Qwen/Qwen3-8B:peft:131072` is Qwen/Qwen3-8B's LoRA service with sequences of at most 131,072
tokens. The base's workers serve it (the queue routes by the base, `served_base`), the run keeps
the name as written (get_info, records) and every door checks its datums against the cap; a cap
above what the base model itself holds is refused on the worker, which alone knows the model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from queue_tinker.errors import UserInputError

PEFT_MARK = ":peft:"
MAX_CONTEXT_CAP = 1 << 24  # 16M tokens: beyond any model's context today
_CAP = re.compile(r"[1-9][0-9]{0,7}")  # as written back: no sign, no leading zero


@dataclass(frozen=True)
class ModelName:
    """A base model name split into what workers serve and the cap it sets."""

    base: str  # the base model: a Hub id, a local directory or a queue-tinker/... name
    context_cap: int | None = None  # at most this many tokens per sequence; None: the model's

    @property
    def text(self) -> str:
        """The name as written: `base`, or `base:peft:<cap>`."""
        cap = self.context_cap
        return self.base if cap is None else f"{self.base}{PEFT_MARK}{cap}"


def parse_model_name(name: str, field: str = "base_model") -> ModelName:
    """`name` split into base and cap; a `:peft:` tail that is not a whole number of tokens
    from 1 to MAX_CONTEXT_CAP, or has no base before it, is refused naming `field`."""
    base, mark, cap = name.rpartition(PEFT_MARK)
    if not mark:
        return ModelName(name)
    if not base or not _CAP.fullmatch(cap) or int(cap) > MAX_CONTEXT_CAP:
        raise UserInputError(
            f"{field}: {name!r} must name a context cap as Base{PEFT_MARK}<tokens>, a whole "
            f"number from 1 to {MAX_CONTEXT_CAP} after a base model "
            f"(e.g. Qwen/Qwen3-8B{PEFT_MARK}131072), got {cap!r} after {base!r}"
        )
    return ModelName(base, int(cap))


def served_base(name: str) -> str:
    """The base model whose workers serve `name` (the name itself when it sets no cap)."""
    return parse_model_name(name).base


def check_served_name(name: str, served: str, context_length: int | None) -> int | None:
    """On a worker serving `served` (whose model holds `context_length` tokens): the cap
    `name` sets, or None. Refused when `name` is another base model's, or caps above the
    model's own context (both numbers named)."""
    parsed = parse_model_name(name)
    if parsed.base != served:
        raise UserInputError(f"base_model: {name!r} is not served by this worker ({served})")
    cap = parsed.context_cap
    if cap is not None and context_length is not None and cap > context_length:
        raise UserInputError(
            f"base_model: {name!r} caps the context at {cap} tokens, more than {served}'s own "
            f"context of {context_length}; ask for at most {PEFT_MARK}{context_length}"
        )
    return cap
