"""Client API: ServiceClient -> TrainingClient / SamplingClient; every call returns an
APIFuture."""

from queue_tinker.client.future import APIFuture
from queue_tinker.client.queue_state import QueueStateChange, QueueStateObserver
from queue_tinker.client.sampling import SamplingClient
from queue_tinker.client.service import ServiceClient
from queue_tinker.client.training import TrainingClient

__all__ = [
    "APIFuture",
    "QueueStateChange",
    "QueueStateObserver",
    "SamplingClient",
    "ServiceClient",
    "TrainingClient",
]
