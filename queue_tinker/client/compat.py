"""Arguments the SDK's methods take that this service has no use for: each is accepted with
its SDK default, and anything else is refused naming the argument, never silently dropped."""

from __future__ import annotations

from typing import Any

from queue_tinker.errors import UserInputError

_ADAM = ("adam", "adamw")


def adamw_only(optimizer: Any) -> None:
    """`optimizer=`: None or an AdamW config; this service trains with AdamW only."""
    if optimizer is None:
        return
    kind = (
        optimizer.get("type") if isinstance(optimizer, dict) else getattr(optimizer, "type", None)
    )
    if str(kind).lower() not in _ADAM:
        raise UserInputError(
            f"optimizer: {kind!r} is not supported; this service trains with AdamW (pass None)"
        )


def unused(name: str, value: Any, default: Any, why: str) -> None:
    if value != default:
        raise UserInputError(f"{name}: {why}; leave it at {default!r}")


def no_weights_token(token: str | None) -> None:
    unused(
        "weights_access_token",
        token,
        None,
        "not used here (a tenant loads its own checkpoints, and no one else's)",
    )


def no_checkpoint_metadata(user_metadata: dict[str, str] | None) -> None:
    unused(
        "user_metadata",
        user_metadata,
        None,
        "checkpoints keep no user_metadata here "
        "(training runs do: create_lora_training_client(user_metadata=...))",
    )
