"""Limits on request size (QT_MAX_TOKENS_PER_DATUM, QT_MAX_DATUMS_PER_REQUEST,
QT_MAX_SAMPLES_PER_REQUEST, QT_MAX_REQUEST_BYTES): the Python client refuses before it
enqueues, the gateway answers 400 on the decoded request and 413 on a body over the cap before
parsing it, and the worker refuses an op that came from a client configured otherwise, and
carries on. A real LoRA worker, a real gateway, the official SDK."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import redis
import tinker
from procs import SDK_CLIENT_MARKS, lora_deployment, make_key, sdk_client
from tinker import types as sdk
from tinker.proto import tinker_public_pb2 as pb

from queue_tinker.client import ServiceClient, TrainingClient
from queue_tinker.errors import ErrorCategory, RequestFailedError, UserInputError
from queue_tinker.queue.keys import Keys
from queue_tinker.settings import Settings
from queue_tinker.types import Datum, ModelInput, SamplingParams
from queue_tinker.types.requests.request_limits import RequestLimits, size_text

TINY = "queue-tinker/tiny-llama"
LIMITS = {
    "max_tokens_per_datum": 32,
    "max_datums_per_request": 4,
    "max_samples_per_request": 3,
    "max_request_bytes": 64 * 1024,
}

pytestmark = SDK_CLIENT_MARKS


@pytest.fixture(scope="module")
def deployment(redis_url: str, database_url: str) -> Iterator[Settings]:
    with lora_deployment(redis_url, database_url, TINY, **LIMITS) as settings:
        yield settings


@pytest.fixture(scope="module")
def key(deployment: Settings) -> str:
    return make_key(deployment, f"limits-{uuid.uuid4().hex[:8]}")


@pytest.fixture(scope="module")
def service(deployment: Settings) -> Iterator[ServiceClient]:
    client = ServiceClient(deployment)
    yield client
    client.close()


@pytest.fixture(scope="module")
def trainer(service: ServiceClient) -> TrainingClient:
    return service.create_lora_training_client(TINY, rank=4, seed=1)


def datum(n: int) -> Datum:
    tokens = [3 + i % 200 for i in range(n + 1)]
    return Datum(
        model_input=ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": np.array(tokens[1:])},
    )


def last_seq(settings: Settings, model_id: str) -> int:
    client = redis.Redis.from_url(settings.redis_url or "")
    try:
        return int(client.hget(Keys(settings.key_prefix).model_meta(model_id), "last_seq") or 0)
    finally:
        client.close()


def worker_pid(settings: Settings) -> int:
    client = redis.Redis.from_url(settings.redis_url or "", decode_responses=True)
    try:
        keys = Keys(settings.key_prefix)
        [worker_id] = client.zrange(keys.workers(), 0, -1)
        return int(client.hget(keys.worker(worker_id), "pid"))  # type: ignore[arg-type]
    finally:
        client.close()


# --- the one definition ---------------------------------------------------------------------
def test_limits_come_from_the_settings_and_default_to_a_real_services() -> None:
    assert RequestLimits.defaults() == RequestLimits(
        tokens_per_datum=32_768,
        datums_per_request=1_024,
        samples_per_request=1_024,
        request_bytes=64 << 20,
    )
    settings = Settings(**LIMITS)  # type: ignore[arg-type]
    assert RequestLimits.of(settings) == RequestLimits(32, 4, 3, 64 * 1024)
    assert [size_text(n) for n in (900, 2048, 73_610_035)] == ["900 bytes", "2.0 KiB", "70.2 MiB"]


# --- the Python client: refused before anything is enqueued -----------------------------------
@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda t: t.forward([datum(3)] * 5, "cross_entropy"),
            "data: 5 datums is more than QT_MAX_DATUMS_PER_REQUEST=4 allows in one request; split "
            "the batch into several calls",
        ),
        (
            lambda t: t.forward_backward([datum(3), datum(3), datum(33)], "cross_entropy"),
            "data[2].model_input: 33 tokens is more than QT_MAX_TOKENS_PER_DATUM=32 allows in one "
            "sequence",
        ),
        (
            lambda t: t.ping(b"x" * 70_000),
            "request: the encoded body is 68.4 KiB, more than QT_MAX_REQUEST_BYTES=65536 "
            "(64.0 KiB) allows; split it into smaller requests",
        ),
    ],
)
def test_the_client_refuses_an_oversize_training_call_before_enqueueing(
    deployment: Settings, trainer: TrainingClient, call: Any, message: str
) -> None:
    before = last_seq(deployment, trainer.model_id)
    with pytest.raises(UserInputError) as caught:
        call(trainer)
    assert caught.value.message == message
    assert last_seq(deployment, trainer.model_id) == before
    assert trainer.forward([datum(32)] * 4, "cross_entropy").result(60).loss > 0  # at the limit


def test_the_client_refuses_an_oversize_sample_before_enqueueing(
    service: ServiceClient, deployment: Settings
) -> None:
    sampler = service.create_sampling_client(base_model=TINY)
    before = last_seq(deployment, sampler.sampler_id)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    cases = [
        (
            lambda: sampler.sample(ModelInput.from_ints([5] * 8), 4, params),
            "num_samples: 4 is more than QT_MAX_SAMPLES_PER_REQUEST=3 allows in one request; "
            "send several requests",
        ),
        (
            lambda: sampler.sample(ModelInput.from_ints([5] * 33), 1, params),
            "prompt: 33 tokens is more than QT_MAX_TOKENS_PER_DATUM=32 allows in one sequence",
        ),
        (
            lambda: sampler.sample(ModelInput.from_ints([5] * 8), 1, SamplingParams(max_tokens=40)),
            "sampling_params.max_tokens: 40 is more than QT_MAX_TOKENS_PER_DATUM=32 allows in "
            "one sequence",
        ),
        (
            lambda: sampler.compute_logprobs(ModelInput.from_ints([5] * 33)),
            "prompt: 33 tokens is more than QT_MAX_TOKENS_PER_DATUM=32 allows in one sequence",
        ),
    ]
    for call, message in cases:
        with pytest.raises(UserInputError) as caught:
            call()
        assert caught.value.message == message
    assert last_seq(deployment, sampler.sampler_id) == before
    result = sampler.sample(ModelInput.from_ints([5] * 8), 3, params).result(60)
    assert len(result.sequences) == 3


# --- the worker: the same limits again, for ops from elsewhere ---------------------------------
def test_the_worker_refuses_what_a_laxer_client_sent_and_carries_on(
    deployment: Settings, trainer: TrainingClient
) -> None:
    """A client configured with bigger limits than the deployment's: its oversize ops reach the
    worker, fail there as the user's errors naming the field, and the worker keeps serving."""
    pid = worker_pid(deployment)
    lax = deployment.model_copy(
        update={
            "max_tokens_per_datum": 32_768,
            "max_datums_per_request": 1_024,
            "max_samples_per_request": 1_024,
            "max_request_bytes": 64 << 20,
        }
    )
    with ServiceClient(lax) as service:
        model = service.training_client(trainer.model_id)
        sampler = service.create_sampling_client(base_model=TINY)
        cases = [
            (
                model.forward([datum(3)] * 5, "cross_entropy"),
                "data: 5 datums is more than QT_MAX_DATUMS_PER_REQUEST=4",
            ),
            (
                model.forward_backward([datum(40)], "cross_entropy"),
                "data[0].model_input: 40 tokens is more than QT_MAX_TOKENS_PER_DATUM=32",
            ),
            (
                model.ping(b"x" * 100_000),
                "request: the encoded body is 97.7 KiB, more than QT_MAX_REQUEST_BYTES=65536",
            ),
            (
                sampler.sample(ModelInput.from_ints([5, 6]), 5, SamplingParams(max_tokens=2)),
                "num_samples: 5 is more than QT_MAX_SAMPLES_PER_REQUEST=3",
            ),
            (
                sampler.sample(ModelInput.from_ints([5] * 40), 1, SamplingParams(max_tokens=2)),
                "prompt: 40 tokens is more than QT_MAX_TOKENS_PER_DATUM=32",
            ),
        ]
        for future, message in cases:
            with pytest.raises(RequestFailedError) as caught:
                future.result(60)
            assert caught.value.category is ErrorCategory.USER
            assert caught.value.message.startswith(message), caught.value.message
        assert model.forward([datum(4)], "cross_entropy").result(60).loss > 0
    assert worker_pid(deployment) == pid
    os.kill(pid, 0)  # still the same process, alive


# --- the gateway -------------------------------------------------------------------------------
class Wire:
    def __init__(self, gateway: str, key: str) -> None:
        self.http = httpx.Client(
            base_url=gateway + "/api/v1", headers={"X-API-Key": key}, timeout=60
        )

    def post(self, endpoint: str, **body: Any) -> httpx.Response:
        return self.http.post(endpoint, json=body)

    def new_model(self) -> str:
        session = self.post("/create_session").json()["session_id"]
        created = self.post(
            "/create_model",
            session_id=session,
            model_seq_id=0,
            base_model=TINY,
            lora_config={"rank": 4},
        ).json()
        assert "model_id" in self.result(created["request_id"])
        return str(created["model_id"])

    def result(self, request_id: str) -> Any:
        response = self.post("/retrieve_future", request_id=request_id)
        assert response.status_code == 200, response.text
        return response.json()


def proto_forward(model_id: str, seq_id: int, sizes: list[int]) -> bytes:
    request = pb.ForwardBackwardRequest(
        model_id=model_id, seq_id=seq_id, loss_fn="cross_entropy", forward_only=True
    )
    for n in sizes:
        tokens = [3 + i % 200 for i in range(n + 1)]
        item = request.data.add()
        item.model_input.add().encoded_text.tokens = np.array(tokens[:-1], "<i4").tobytes()
        target = item.loss_fn_inputs["target_tokens"]
        target.dense, target.dtype = np.array(tokens[1:], "<i8").tobytes(), pb.DTYPE_INT64
    return request.SerializeToString()


@pytest.fixture(scope="module")
def wire(gateway: str, key: str) -> Iterator[Wire]:
    client = Wire(gateway, key)
    yield client
    client.http.close()


PROTOBUF = {"Content-Type": "application/x-protobuf"}


def test_the_gateway_refuses_an_oversize_request_with_400_naming_the_field(wire: Wire) -> None:
    """The decoded request's limits, protobuf and JSON alike; a refused request still takes its
    turn, so the next one runs."""
    model = wire.new_model()
    too_many = wire.http.post(
        "/forward_backward", content=proto_forward(model, 1, [3] * 5), headers=PROTOBUF
    )
    assert too_many.status_code == 400
    assert too_many.json()["detail"].startswith(
        "data: 5 datums is more than QT_MAX_DATUMS_PER_REQUEST=4"
    )
    datum_json = {
        "model_input": {"chunks": [{"tokens": list(range(3, 36))}]},
        "loss_fn_inputs": {"target_tokens": {"data": list(range(4, 37)), "dtype": "int64"}},
    }
    too_long = wire.post(
        "/forward",
        model_id=model,
        seq_id=2,
        forward_input={"data": [datum_json], "loss_fn": "cross_entropy"},
    )
    assert too_long.status_code == 400
    assert too_long.json()["detail"] == (
        "data[0].model_input: 33 tokens is more than QT_MAX_TOKENS_PER_DATUM=32 allows in one "
        "sequence"
    )
    sparse = pb.ForwardBackwardRequest.FromString(proto_forward(model, 3, [3]))
    weights = sparse.data[0].loss_fn_inputs["weights"]
    weights.dtype, weights.shape[:] = pb.DTYPE_FLOAT32, [1, 1 << 28]  # 1 GiB, were it dense
    weights.sparse_csr.crow_indices = np.array([0, 0], "<i8").tobytes()
    bomb = wire.http.post("/forward_backward", content=sparse.SerializeToString(), headers=PROTOBUF)
    assert bomb.status_code == 400
    assert "QT_MAX_TOKENS_PER_DATUM=32" in bomb.json()["detail"]
    session = wire.post(
        "/create_sampling_session",
        session_id=model.split(":")[0],
        sampling_session_seq_id=0,
        base_model=TINY,
    ).json()
    samples = wire.post(
        "/asample",
        sampling_session_id=session["sampling_session_id"],
        seq_id=0,
        num_samples=9,
        prompt={"chunks": [{"tokens": [5, 6]}]},
        sampling_params={"max_tokens": 2},
    )
    assert samples.status_code == 400
    assert samples.json()["detail"].startswith(
        "num_samples: 9 is more than QT_MAX_SAMPLES_PER_REQUEST=3"
    )
    ok = wire.http.post(
        "/forward_backward", content=proto_forward(model, 4, [32] * 4), headers=PROTOBUF
    )
    assert ok.status_code == 200, ok.text
    assert "loss_fn_outputs" in wire.result(ok.json()["request_id"])


def test_a_body_over_the_cap_is_answered_413_before_it_is_parsed(
    wire: Wire, gateway: str, key: str
) -> None:
    model = wire.new_model()
    big = proto_forward(model, 1, [4] * 2) + b"\x00" * 70_000  # not even valid protobuf
    declared = wire.http.post("/forward_backward", content=big, headers=PROTOBUF)
    assert declared.status_code == 413
    assert declared.json() == {
        "detail": (
            f"request: the HTTP body is {size_text(len(big))}, more than "
            "QT_MAX_REQUEST_BYTES=65536 (64.0 KiB) allows; split it into smaller requests"
        )
    }
    # No Content-Length (chunked): counted as it streams, so no length is trusted.
    chunks = (b"{" + b" " * 8191 for _ in range(12))
    streamed = wire.http.post(
        "/forward", content=chunks, headers={"Content-Type": "application/json"}
    )
    assert streamed.status_code == 413
    assert streamed.json()["detail"].startswith(
        "request: the HTTP body is more than QT_MAX_REQUEST_BYTES=65536 (64.0 KiB)"
    )
    # The answer comes once the cap is passed, while the client is still sending.
    host, port = gateway.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as raw:
        raw.sendall(
            b"POST /api/v1/forward HTTP/1.1\r\nHost: gw\r\nX-API-Key: "
            + key.encode()
            + b"\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        for _ in range(10):
            raw.sendall(b"2000\r\n" + b" " * 0x2000 + b"\r\n")  # 80 KiB, and no last chunk
        assert raw.recv(4096).startswith(b"HTTP/1.1 413")
    assert (
        wire.http.post(
            "/forward_backward", content=proto_forward(model, 1, [4]), headers=PROTOBUF
        ).status_code
        == 200
    )  # under the cap: as before


def test_the_official_sdk_hears_the_limit(gateway: str, key: str) -> None:
    with sdk_client(gateway, key) as service:
        trainer = service.create_lora_training_client(base_model=TINY, rank=4).result()
        tokens = list(range(3, 43))
        batch = [
            sdk.Datum(
                model_input=sdk.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": np.array(tokens[1:])},
            )
        ]
        with pytest.raises(
            tinker.BadRequestError,
            match=r"data\[0\]\.model_input: 39 tokens "
            r"is more than QT_MAX_TOKENS_PER_DATUM",
        ):
            trainer.forward(batch, "cross_entropy").result(timeout=60)
