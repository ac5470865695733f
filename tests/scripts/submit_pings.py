"""A second client process for the ordering test: submit pings to given models, print results.

Usage: submit_pings.py TAG OPS_PER_MODEL MODEL_ID... (settings come from QT_* env vars)
Prints one JSON object per op: {"model", "request_id", "data", "seq"}.
"""

from __future__ import annotations

import json
import sys

from queue_tinker.client import ServiceClient


def main() -> None:
    tag, per_model, model_ids = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    with ServiceClient() as service:
        clients = [service.training_client(m) for m in model_ids]
        futures = []
        for i in range(per_model):
            for client in clients:
                futures.append((client.model_id, client.ping([tag, i])))
        for model_id, future in futures:
            result = future.result(timeout=120)
            print(
                json.dumps(
                    {
                        "model": model_id,
                        "request_id": future.request_id,
                        "data": result["data"],
                        "seq": result["seq"],
                    }
                )
            )


if __name__ == "__main__":
    main()
