"""queue_tinker: a self-hosted, Tinker-style LoRA fine-tuning and sampling service.

import queue_tinker as tinker
from queue_tinker import types

service = tinker.ServiceClient()
training = service.create_lora_training_client(base_model="queue-tinker/tiny-llama")
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from queue_tinker.client import APIFuture, SamplingClient, ServiceClient, TrainingClient

__all__ = ["APIFuture", "SamplingClient", "ServiceClient", "TrainingClient"]


def __getattr__(name: str) -> Any:
    # Lazy, so `import queue_tinker.types` (workers, gateway) does not pull in the client.
    if name in __all__:
        from queue_tinker import client

        return getattr(client, name)
    raise AttributeError(f"module 'queue_tinker' has no attribute {name!r}")
