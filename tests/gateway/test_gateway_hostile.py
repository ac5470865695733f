"""What a hostile or careless client found answered 500 (or 200) where a 4xx with a message
naming the field is due: the gateway app in process, on real Redis and Postgres, no worker
(every case here is refused before one would run)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import redis
from fastapi.testclient import TestClient
from procs import make_key
from tinker.proto import tinker_public_pb2 as pb

from queue_tinker.gateway.app import create_app
from queue_tinker.queue.keys import Keys
from queue_tinker.settings import Settings

TINY = "queue-tinker/tiny-llama"
JSON = {"Content-Type": "application/json"}
PROTOBUF = {"Content-Type": "application/x-protobuf"}


@dataclass
class Caller:
    http: TestClient
    headers: dict[str, str]
    session: str
    model: str
    settings: Settings

    def call(self, method: str, path: str, body: Any = None, **headers: str) -> Any:
        content = json.dumps(body) if isinstance(body, dict) else body
        hdrs = {**self.headers, **(JSON if isinstance(body, dict) else {}), **headers}
        return self.http.request(method, "/api/v1" + path, content=content, headers=hdrs)

    def next_seq_id(self) -> int:
        client = redis.Redis.from_url(self.settings.redis_url or "")
        try:
            raw = client.hget(Keys(self.settings.key_prefix).model_meta(self.model), "next_seq_id")
        finally:
            client.close()
        return int(raw or 1)


@pytest.fixture
def caller(settings: Settings) -> Iterator[Caller]:
    headers = {"X-API-Key": make_key(settings, f"hostile-{uuid.uuid4().hex[:6]}")}
    with TestClient(create_app(settings), raise_server_exceptions=False) as http:
        session = http.post("/api/v1/create_session", headers=headers).json()["session_id"]
        created = http.post(
            "/api/v1/create_model",
            headers=headers,
            json={"session_id": session, "model_seq_id": 0, "base_model": TINY},
        ).json()
        yield Caller(http, headers, session, created["model_id"], settings)


def detail(response: Any) -> str:
    """The detail as text: a 422's list of errors is reduced to the fields they name."""
    body = response.json()["detail"]
    if isinstance(body, list):
        return " ".join(".".join(str(p) for p in error["loc"]) for error in body)
    return str(body)


def fb_request(model: str, seq_id: int, shape: list[int]) -> bytes:
    request = pb.ForwardBackwardRequest(model_id=model, seq_id=seq_id, loss_fn="cross_entropy")
    item = request.data.add()
    item.model_input.add().encoded_text.tokens = np.array([5, 6, 7], "<i4").tobytes()
    target = item.loss_fn_inputs["target_tokens"]
    target.dense, target.dtype = np.array([6, 7, 8], "<i8").tobytes(), pb.DTYPE_INT64
    target.shape[:] = shape
    return request.SerializeToString()


NOT_UTF8 = b"\xff\xfe\x81\x00"
# (method, path, body, extra headers, status, a word the detail must hold)
CASES = [
    ("GET", "/training_runs/abc%00", None, {}, 404, "path"),
    ("GET", "/training_runs/abc%00/checkpoints", None, {}, 404, "path"),
    ("GET", "/sessions/a%00", None, {}, 404, "path"),
    ("GET", "/samplers/a%00", None, {}, 404, "path"),
    ("DELETE", "/training_runs/a%00/checkpoints/weights/x", None, {}, 404, "path"),
    ("GET", "/dashboard/requests/a%00", None, {}, 404, "path"),
    ("GET", "/dashboard/runs/a%00/loss", None, {}, 404, "path"),
    ("GET", "/dashboard/requests?model=a%00", None, {}, 422, "model"),
    ("GET", "/training_runs?offset=99999999999999999999", None, {}, 422, "offset"),
    ("GET", "/checkpoints?offset=99999999999999999999", None, {}, 422, "offset"),
    ("GET", "/sessions?offset=99999999999999999999", None, {}, 422, "offset"),
    ("POST", "/weights_info", {"tinker_path": "tinker://a\x00/weights/x"}, {}, 400, "tinker_path"),
    ("POST", "/optim_step", '{"model_id": NaN, "seq_id": 1}', JSON, 422, "model_id"),
    ("POST", "/optim_step", NOT_UTF8, {"Content-Type": "application/msgpack"}, 415, "Content-Type"),
    ("POST", "/get_info", NOT_UTF8, {"Content-Type": "application/msgpack"}, 415, "Content-Type"),
    (
        "POST",
        "/create_session",
        NOT_UTF8,
        {"Content-Type": "application/msgpack"},
        415,
        "Content-Type",
    ),
    (
        "POST",
        "/forward_backward",
        b"x",
        {"Content-Type": "application/x-protobuf", "Content-Encoding": "gzip"},
        415,
        "Content-Encoding",
    ),
    ("POST", "/optim_step", NOT_UTF8, JSON, 422, "body"),
    ("POST", "/optim_step", "[" * 100_000, JSON, 422, "body"),
    ("POST", "/asample", "[" * 10_000, JSON, 422, "body"),
    ("PUT", "/training_runs/r/checkpoints/weights/x/ttl", "[" * 100_000, JSON, 422, "body"),
    ("POST", "/weights_info", "[" * 100_000, JSON, 422, "body"),
]


@pytest.mark.parametrize(("method", "path", "body", "headers", "status", "field"), CASES)
def test_hostile_requests_get_the_precise_4xx(
    caller: Caller,
    method: str,
    path: str,
    body: Any,
    headers: dict[str, str],
    status: int,
    field: str,
) -> None:
    """NUL ids, offsets past bigint, a JSON NaN, bodies that are not UTF-8 or in a content
    type or encoding the protocol does not use, 100k nested brackets: each its precise 4xx
    with a detail naming the field (all were 500s)."""
    response = caller.call(method, path, body, **headers)
    assert response.status_code == status, response.text[:500]
    assert field in detail(response), response.text[:500]


def test_a_reply_key_is_not_a_request_id(caller: Caller) -> None:
    """retrieve_future of '<request id>:reply' is 404 like any unknown id (the reply string
    shared the job's key namespace: WRONGTYPE, a 500, and an oracle of existing ids)."""
    saved = caller.call(
        "POST", "/save_weights_for_sampler", {"model_id": caller.model, "seq_id": 1}
    ).json()
    response = caller.call(
        "POST", "/retrieve_future", {"request_id": saved["request_id"] + ":reply"}
    )
    assert response.status_code == 404, response.text
    assert "request_id" in detail(response)


def test_a_65_dimension_shape_is_refused_and_uses_its_seq_id(caller: Caller) -> None:
    """A tensor shape of 65 dimensions is 400 naming the tensor (numpy's own error was a 500),
    and its seq_id is used, so the model's next call does not wait out the gap timeout."""
    response = caller.call(
        "POST", "/forward_backward", fb_request(caller.model, 1, [1] * 65), **PROTOBUF
    )
    assert response.status_code == 400, response.text
    assert "data[0].loss_fn_inputs['target_tokens']: shape has 65 dimensions" in detail(response)
    assert caller.next_seq_id() == 2


@pytest.mark.parametrize("base_model", ["a\x00b", "line\nbreak", "<b>bold</b>", " ", "x" * 600])
def test_create_model_refuses_a_malformed_base_model(caller: Caller, base_model: str) -> None:
    """create_model with a NUL, a newline, markup, blank or a 600-character base_model is 400
    naming base_model (a NUL dead-lettered the run's record)."""
    response = caller.call(
        "POST",
        "/create_model",
        {"session_id": caller.session, "model_seq_id": 1, "base_model": base_model},
    )
    assert response.status_code == 400, response.text
    assert detail(response).startswith("base_model:")


def test_finishing_another_tenants_session_is_404(caller: Caller, settings: Settings) -> None:
    """POST /sessions/{id}/finish answers 200 for one's own session, 404 for another
    tenant's (it answered 200)."""
    assert caller.call("POST", f"/sessions/{caller.session}/finish").status_code == 200
    other = {"X-API-Key": make_key(settings, f"other-{uuid.uuid4().hex[:6]}")}
    response = caller.http.post(f"/api/v1/sessions/{caller.session}/finish", headers=other)
    assert response.status_code == 404, response.text
    assert "session_id" in detail(response)


def test_calls_far_ahead_of_the_order_are_refused_not_held(settings: Settings) -> None:
    """A call past the seq_id window is 400 naming seq_id; one past the held-ops cap is 429
    with Retry-After (the SDK retries it), and the call the model waits for still runs."""
    capped = settings.model_copy(update={"held_ops_window": 8, "held_ops_max": 2})
    headers = {"X-API-Key": make_key(settings, f"held-{uuid.uuid4().hex[:6]}")}
    with TestClient(create_app(capped), raise_server_exceptions=False) as http:
        session = http.post("/api/v1/create_session", headers=headers).json()["session_id"]
        model = http.post(
            "/api/v1/create_model",
            headers=headers,
            json={"session_id": session, "model_seq_id": 0, "base_model": TINY},
        ).json()["model_id"]

        def step(seq_id: int) -> Any:
            return http.post(
                "/api/v1/optim_step",
                headers=headers,
                json={"model_id": model, "seq_id": seq_id, "adam_params": {"learning_rate": 1e-3}},
            )

        far = step(1_000_000)
        assert far.status_code == 400 and far.json()["detail"].startswith("seq_id: 1000000")
        assert step(2).status_code == 200 and step(3).status_code == 200
        full = step(4)
        assert full.status_code == 429 and full.headers["Retry-After"] == "1", full.text
        assert full.json()["detail"].startswith("seq_id:")
        assert step(1).status_code == 200
        assert step(4).status_code == 200


def test_only_protobuf_bodies_may_be_big(caller: Caller) -> None:
    """A JSON body over 1 MiB is 413 before it is parsed (json.loads holds the interpreter
    lock: a 57 MiB asample stalled every tenant's requests); a protobuf body of the same size
    is read and judged on its content."""
    big = b'{"prompt": "' + b"x" * (2 << 20) + b'"}'
    refused = caller.call("POST", "/asample", big, **JSON)
    assert refused.status_code == 413, refused.text
    assert refused.json()["detail"].startswith("request: the HTTP body is 2.0 MiB, more than")
    judged = caller.call("POST", "/forward_backward", b"\xff" * (2 << 20), **PROTOBUF)
    assert judged.status_code == 400 and detail(judged).startswith("body:"), judged.text


def test_a_protobuf_proven_oversize_by_its_first_bytes_is_refused_and_uses_its_seq_id(
    caller: Caller,
) -> None:
    """A 20 MiB forward_backward of 5M tokens in one datum is refused 400 naming the datum
    (the gateway reads only its first 64 KiB: the headers prove it over
    QT_MAX_TOKENS_PER_DATUM), and its seq_id is used."""
    request = pb.ForwardBackwardRequest(model_id=caller.model, seq_id=1, loss_fn="cross_entropy")
    request.data.add().model_input.add().encoded_text.tokens = bytes(20 << 20)
    response = caller.call("POST", "/forward_backward", request.SerializeToString(), **PROTOBUF)
    assert response.status_code == 400, response.text
    assert detail(response).startswith("data[0].model_input: 5242880 tokens is more than")
    assert caller.next_seq_id() == 2
