"""Client API: ServiceClient -> TrainingClient; every call returns an APIFuture."""

from queue_tinker.client.future import APIFuture
from queue_tinker.client.service import ServiceClient
from queue_tinker.client.training import TrainingClient

__all__ = ["APIFuture", "ServiceClient", "TrainingClient"]
