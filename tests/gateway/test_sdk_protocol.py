"""The whole SDK 0.38 protocol surface: every `/api/v1/...` path in the installed tinker SDK is
served or answers a documented 501, and the protocol features the gateway turns on
(retrieve_futures, join_sampling_session, cancel_future, the account routes) work through the
real SDK against a real gateway and LoRA worker (docs/tinker-http-protocol.md, section 12)."""

from __future__ import annotations

import asyncio
import dataclasses
import pickle
import re
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import redis
import tinker
import zstandard
from custom_losses import LOSSES
from procs import REPO, SDK_CLIENT_MARKS, make_key, sdk_client
from test_gateway_sdk import ops_of as recorded_ops
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.types.forward_backward_request import ForwardBackwardRequest

from queue_tinker.gateway.tinker.sample_futures import SDK_CANCEL_REASON
from queue_tinker.gateway.tinker.unserved import UNSERVED
from queue_tinker.queue.connection import connect
from queue_tinker.queue.keys import Keys
from queue_tinker.queue.ops.jobs import JobQueue
from queue_tinker.queue.ops.runs import open_sampling_session
from queue_tinker.settings import Settings
from queue_tinker.store import api_keys
from queue_tinker.store.db import make_engine, session_factory

TINY = "queue-tinker/tiny-llama"
SDK_DIR = Path(tinker.__file__).parent
PROTOCOL_DOC = REPO / "docs" / "tinker-http-protocol.md"
# FastAPI's answers for a path or method it has no route for: what no SDK path may get.
BARE = [(404, {"detail": "Not Found"}), (405, {"detail": "Method Not Allowed"})]

pytestmark = SDK_CLIENT_MARKS


# --- the path table ------------------------------------------------------------------------
def sdk_paths() -> set[tuple[str, str]]:
    """(method, path) of every `/api/v1/...` string literal in the SDK's source (tests
    excluded); the method is the call the literal is passed to, in the lines before it."""
    found = set()
    for source in SDK_DIR.rglob("*.py"):
        if source.name.endswith("_test.py") or "tests" in source.parts:
            continue
        text = source.read_text()
        for match in re.finditer(r"""f?["'](/api/v1/[^"'\s]*)["']""", text):
            before = text[max(0, match.start() - 400) : match.start()]
            calls = re.findall(
                r"""(?:\.|_)(get|post|put|delete|patch)\(|"""
                r"""_request\(\s*["'](GET|POST|PUT|DELETE)["']""",
                before,
            )
            if calls:
                method = (calls[-1][0] or calls[-1][1]).upper()
                found.add((method, match.group(1)))
    return found


def concrete(path: str) -> str:
    """A template path with probe values: a checkpoint id holds a '/'."""
    path = path.replace("{checkpoint_id}", "weights/probe")
    return re.sub(r"\{[a-z_]+\}", "probe", path)


def documented_paths() -> dict[tuple[str, str], str]:
    """(method, path) -> what the protocol page's table of SDK paths says about it."""
    rows = re.findall(
        r"^\| `(GET|POST|PUT|DELETE) (/api/v1/[^`]*)` \| ([^|]+) \|", PROTOCOL_DOC.read_text(), re.M
    )
    return {(method, path): answer.strip() for method, path, answer in rows}


def test_sdk_paths_are_found() -> None:
    """The extraction sees the SDK's calls (a change of its source layout would empty it)."""
    paths = sdk_paths()
    assert ("POST", "/api/v1/forward_backward") in paths
    assert ("DELETE", "/api/v1/auth/apikey/me") in paths
    assert (
        "GET",
        "/api/v1/training_runs/{training_run_id}/checkpoints/{checkpoint_id}/external_weights_urls",
    ) in paths or (
        "GET",
        "/api/v1/training_runs/{model_id}/checkpoints/{checkpoint_id}/external_weights_urls",
    ) in paths
    assert len(paths) >= 40


def test_every_sdk_path_is_served_or_answers_its_documented_501(
    gateway: str, key: str, deployment: Settings
) -> None:
    """Each (method, path) the SDK calls gets a route of ours (any answer but FastAPI's bare
    404/405); a 501 names its feature, as the protocol page's table says."""
    documented = documented_paths()
    details = {(u.method, concrete(u.path.replace(":path", ""))): u.detail for u in UNSERVED}
    for method, path in sorted(sdk_paths()):
        assert (method, path) in documented, f"{method} {path} is not in the path table"
        # Revoking the key presented is what DELETE apikey/me does: give it a key of its own.
        probe_key = (
            make_key(deployment, "probe-revoke")
            if path.endswith("/me") and method == "DELETE"
            else key
        )
        response = httpx.request(
            method,
            gateway + concrete(path),
            json={} if method in ("POST", "PUT") else None,
            headers={"X-API-Key": probe_key},
            timeout=30,
        )
        body = response.json() if response.content else None
        assert (response.status_code, body) not in BARE, f"{method} {path}: {body}"
        if response.status_code == 501:
            assert body == {"detail": details[(method, concrete(path))]}
            assert response.headers["x-should-retry"] == "false"
            assert documented[(method, path)].startswith("501"), (method, path)
        else:
            assert not documented[(method, path)].startswith("501"), (method, path, body)


def test_client_config_turns_on_the_served_features(sdk_service: tinker.ServiceClient) -> None:
    """The SDK reads batched polling, client ids, zstd bodies, server-side custom losses and
    cancel as on; the JWT exchange as off."""
    holder = sdk_service.holder  # it fetched both configs at start
    config = holder.get_client_config()
    assert config.sample_use_retrieve_futures and config.sample_join_sampling_session
    assert config.custom_loss_server_side and config.proto_compress_fwdbwd
    assert not config.pjwt_auth_enabled
    assert holder._client_dynamic_config.sample_cancel_enabled


# --- batched polling and client ids --------------------------------------------------------
def test_samples_resolve_through_retrieve_futures(
    sdk_service: tinker.ServiceClient, deployment: Settings
) -> None:
    """Many samples in flight resolve through one client's batched polls: each got a
    completion on the client's cursor, and each result is the sample's own."""
    sampler = sdk_service.create_sampling_client(base_model=TINY).result()
    prompts = [[3 + i, 4, 5] for i in range(6)]
    futures = [
        sampler.sample(types.ModelInput.from_ints(p), 2, types.SamplingParams(max_tokens=3, seed=i))
        for i, p in enumerate(prompts)
    ]
    results = [f.result(timeout=120) for f in futures]
    assert all(len(r.sequences) == 2 for r in results)
    client = redis.Redis.from_url(deployment.redis_url or "")
    keys = Keys(deployment.key_prefix)
    sampler_id = sampler._sampling_session_id
    assert int(client.get(keys.sample_cursor(sampler_id, 0))) == len(prompts)
    assert client.scard(keys.sample_pending(sampler_id, 0)) == 0
    client.close()


def test_retrieve_futures_answers_each_completion_once_past_the_cursor(
    gateway: str, key: str, sdk_service: tinker.ServiceClient
) -> None:
    """On the wire: a poll returns the finished samples after prev_cursor; a poll with the
    returned cursor and timeout 0 finds nothing new."""
    sampler = sdk_service.create_sampling_client(base_model=TINY).result()
    sampler_id = sampler._sampling_session_id
    headers = {"X-API-Key": key}
    ids = []
    for seq_id in range(3):
        submitted = httpx.post(
            f"{gateway}/api/v1/asample",
            headers=headers,
            timeout=30,
            json={
                "sampling_session_id": sampler_id,
                "seq_id": seq_id,
                "num_samples": 1,
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": [3, 4, 5]}]},
                "sampling_params": {"max_tokens": 2},
            },
        )
        assert submitted.status_code == 200, submitted.text
        ids.append(submitted.json()["request_id"])
    seen: dict[str, str] = {}
    cursor = 0
    while len(seen) < 3:
        polled = httpx.post(
            f"{gateway}/api/v1/retrieve_futures",
            headers=headers,
            timeout=60,
            json={"target": {"sampling_session_id": sampler_id}, "prev_cursor": cursor},
        ).json()
        assert polled["cursor"] >= cursor
        for completion in polled["completions"]:
            assert completion["request_id"] not in seen
            seen[completion["request_id"]] = completion["state"]
        cursor = polled["cursor"]
    assert seen == dict.fromkeys(ids, "finished")
    again = httpx.post(
        f"{gateway}/api/v1/retrieve_futures",
        headers=headers,
        timeout=30,
        json={"target": {"sampling_session_id": sampler_id}, "prev_cursor": cursor, "timeout": 0},
    ).json()
    assert again == {"completions": [], "cursor": cursor}


def test_pickled_sampling_clients_join_with_distinct_client_ids(
    sdk_service: tinker.ServiceClient, deployment: Settings
) -> None:
    """Two unpickled copies of a SamplingClient each join the session (client ids 1 and 2),
    sample in their own seq_id blocks, and are polled on their own cursors."""
    sampler = sdk_service.create_sampling_client(base_model=TINY).result()
    sampler.sample(
        types.ModelInput.from_ints([3, 4]), 1, types.SamplingParams(max_tokens=2)
    ).result(timeout=120)
    clones = [pickle.loads(pickle.dumps(sampler)) for _ in range(2)]
    for clone in clones:
        result = clone.sample(
            types.ModelInput.from_ints([5, 6]), 1, types.SamplingParams(max_tokens=2)
        ).result(timeout=120)
        assert len(result.sequences) == 1
    assert sorted(c._cloned_sampler_id for c in clones) == [1, 2]
    client = redis.Redis.from_url(deployment.redis_url or "")
    keys = Keys(deployment.key_prefix)
    sampler_id = sampler._sampling_session_id
    assert [int(client.get(keys.sample_cursor(sampler_id, n)) or 0) for n in (0, 1, 2)] == [1, 1, 1]
    client.close()


# --- cancel --------------------------------------------------------------------------------
def test_cancel_future_removes_a_queued_sample(
    gateway: str, key: str, deployment: Settings
) -> None:
    """A sample still in its queue (no worker serves its base model) is removed: its future
    fails as cancelled by the client; another tenant's request reads as unknown."""
    tenant = key_tenant(deployment, key)
    sampler_id = f"cancel-{uuid.uuid4().hex[:6]}:sample:0"
    asyncio.run(open_unserved_sampler(deployment, sampler_id, tenant))
    headers = {"X-API-Key": key}
    submitted = httpx.post(
        f"{gateway}/api/v1/asample",
        headers=headers,
        timeout=30,
        json={
            "sampling_session_id": sampler_id,
            "seq_id": 0,
            "num_samples": 1,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [3, 4]}]},
            "sampling_params": {"max_tokens": 2},
        },
    ).json()
    request_id = submitted["request_id"]
    stranger = {"X-API-Key": make_key(deployment, "proto-stranger")}
    assert (
        httpx.post(
            f"{gateway}/api/v1/cancel_future",
            headers=stranger,
            json={"request_id": request_id},
            timeout=30,
        ).status_code
        == 404
    )
    cancelled = httpx.post(
        f"{gateway}/api/v1/cancel_future",
        headers=headers,
        json={"request_id": request_id},
        timeout=30,
    )
    assert cancelled.status_code == 200, cancelled.text
    answer = httpx.post(
        f"{gateway}/api/v1/retrieve_future",
        headers=headers,
        timeout=30,
        json={"request_id": request_id},
    ).json()
    assert answer == {"error": f"{SDK_CANCEL_REASON} before it ran", "category": "user"}


def key_tenant(deployment: Settings, key: str) -> str:
    return asyncio.run(_tenant(deployment, key))


async def _tenant(deployment: Settings, key: str) -> str:
    engine = make_engine(deployment.database_url or "")
    try:
        return str(await api_keys.tenant_for_key(session_factory(engine), key))
    finally:
        await engine.dispose()


async def open_unserved_sampler(deployment: Settings, sampler_id: str, tenant: str) -> None:
    """A sampling session on a base model no worker serves: its ops wait in the queue."""
    client = connect(deployment.redis_url or "")
    jobs = JobQueue(client, Keys(deployment.key_prefix), result_ttl_s=600)

    async def submit(model_id: str, kind: object, payload: bytes, key: str | None) -> str:
        return (
            await jobs.enqueue(
                model_id,
                kind,
                payload,  # type: ignore[arg-type]
                job_id=f"req-{uuid.uuid4().hex}",
                idempotency_key=key,
            )
        ).job_id

    try:
        await open_sampling_session(
            jobs,
            submit,
            sampler_id,
            base_model="no-worker-base",
            tenant_id=tenant,
            session_id=None,
            model_path=None,
        )
    finally:
        await client.aclose()


# --- account routes ------------------------------------------------------------------------
def test_apikey_me_names_the_key_and_delete_revokes_only_it(
    gateway: str, deployment: Settings
) -> None:
    """GET apikey/me describes the key presented (tenant as organization); DELETE revokes that
    key, which is then refused, and leaves the tenant's other keys working."""
    tenant = f"me-{uuid.uuid4().hex[:6]}"
    first, second = make_key(deployment, tenant), make_key(deployment, tenant)
    me = httpx.get(f"{gateway}/api/v1/auth/apikey/me", headers={"X-API-Key": first}).json()
    assert me["details"]["org_details"]["name"] == tenant and isinstance(me["key_id"], int)
    assert (
        httpx.delete(f"{gateway}/api/v1/auth/apikey/me", headers={"X-API-Key": first}).status_code
        == 200
    )
    again = httpx.get(f"{gateway}/api/v1/auth/apikey/me", headers={"X-API-Key": first})
    assert again.status_code == 401
    other = httpx.get(f"{gateway}/api/v1/auth/apikey/me", headers={"X-API-Key": second})
    assert other.status_code == 200 and other.json()["key_id"] != me["key_id"]


def test_storage_usage_audit_search_and_trace_through_the_sdk(
    gateway: str, sdk_service: tinker.ServiceClient, key: str
) -> None:
    """A saved checkpoint shows in the tenant's storage usage, its audit log and its session's
    search summary; the session's trace export is a Perfetto file with its requests."""
    trainer = sdk_service.create_lora_training_client(base_model=TINY, rank=2, seed=1).result()
    path = trainer.save_state("audited").result(timeout=120).path
    rest = tinker.RestClient(base_url=gateway, api_key=key)
    admin = tinker.AdminClient(base_url=gateway, api_key=key)
    session_id = trainer.model_id.split(":train:")[0]
    checkpoint = wait_for(
        lambda: [
            c for c in rest.list_user_checkpoints().result().checkpoints if c.tinker_path == path
        ]
    )[0]

    headers = {"X-API-Key": key}
    usage = httpx.get(f"{gateway}/api/v1/billing/usage/checkpoints/current", headers=headers).json()
    assert usage["data"][0]["checkpoint_count"] >= 1
    assert usage["data"][0]["size_bytes"] >= checkpoint.size_bytes
    entries = admin.get_audit_log(day=datetime.now(UTC).date()).result().entries
    assert any(
        e.event == "checkpoint_create" and e.event_details["tinker_path"] == path for e in entries
    )
    storage = admin.get_current_checkpoint_storage_usage().result()
    assert storage.data[0].size_bytes == usage["data"][0]["size_bytes"]

    with pytest.warns(tinker.ExperimentalWarning):  # the SDK marks search experimental
        search = rest.search_sessions(types.SessionSearchRequest(session_id=session_id))
    found = search.result()
    assert [s.session_id for s in found.sessions] == [session_id]
    assert found.sessions[0].checkpoints_count == 1

    def traced() -> set[str]:
        url = rest.export_session_trace(session_id).result()
        events = httpx.get(url, headers=headers).json()["traceEvents"]
        return {e["name"] for e in events if e["pid"] == trainer.model_id}

    assert {"create_model", "save_state"} <= traced()
    # A request whose result the client just got is in the trace at once: its events still
    # on their way to Postgres are written first.
    trainer.forward(
        [
            types.Datum(
                model_input=types.ModelInput.from_ints([1, 2]),
                loss_fn_inputs={"target_tokens": np.array([2, 3])},
            )
        ],
        "cross_entropy",
    ).result(timeout=60)
    assert "forward" in traced()


def wait_for(probe: Callable[[], list[Any]], timeout: float = 30) -> list[Any]:
    """The probe's first non-empty answer (rows are written behind, within a second)."""
    deadline = time.monotonic() + timeout
    while True:
        got = probe()
        if got or time.monotonic() > deadline:
            assert got, "nothing turned up"
            return got
        time.sleep(0.2)


# --- zstd request bodies -------------------------------------------------------------------
def text_batch(n: int) -> list[types.Datum]:
    return [
        types.Datum(
            model_input=types.ModelInput.from_ints([3 + i, 4, 5, 6 + i]),
            loss_fn_inputs={"target_tokens": np.array([4, 5, 6 + i, 7])},
        )
        for i in range(n)
    ]


def proto_body(model_id: str, seq_id: int, data: list[types.Datum]) -> bytes:
    message = forward_backward_request_to_proto(
        ForwardBackwardRequest(
            forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn="cross_entropy"),
            model_id=model_id,
            seq_id=seq_id,
        )
    )
    message.forward_only = True
    return message.SerializeToString()


def test_compressed_forward_bodies_compute_what_plain_ones_do(
    gateway: str, key: str, sdk_service: tinker.ServiceClient
) -> None:
    """The SDK compresses its forward bodies (proto_compress_fwdbwd on); its result equals that
    of the same request sent uncompressed, and of one compressed by hand."""
    assert sdk_service.holder.get_client_config().proto_compress_fwdbwd
    trainer = sdk_service.create_lora_training_client(base_model=TINY, rank=2, seed=4).result()
    batch = text_batch(3)
    by_sdk = trainer.forward(batch, "cross_entropy").result(timeout=120).metrics["loss:sum"]
    headers = {"X-API-Key": key, "Content-Type": "application/x-protobuf"}
    losses = []
    for seq_id, compress in ((2, False), (3, True)):
        body = proto_body(trainer.model_id, seq_id, batch)
        sent = zstandard.ZstdCompressor().compress(body) if compress else body
        extra = {"Content-Encoding": "zstd"} if compress else {}
        submitted = httpx.post(
            f"{gateway}/api/v1/forward_backward",
            content=sent,
            headers={**headers, **extra},
            timeout=30,
        )
        assert submitted.status_code == 200, submitted.text
        losses.append(result_of(gateway, key, submitted.json()["request_id"])["metrics"])
    assert [m["loss:sum"] for m in losses] == pytest.approx([by_sdk, by_sdk], rel=1e-6)


def result_of(gateway: str, key: str, request_id: str) -> dict[str, Any]:
    while True:
        answer = httpx.post(
            f"{gateway}/api/v1/retrieve_future",
            headers={"X-API-Key": key},
            json={"request_id": request_id},
            timeout=60,
        ).json()
        if answer.get("type") != "try_again":
            return answer  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("encoding", "body", "status", "detail"),
    [
        (
            "zstd",
            zstandard.ZstdCompressor().compress(bytes(64 * 2**20 + 1)),
            400,
            "request: the inflated zstd body is more than QT_MAX_REQUEST_BYTES=67108864",
        ),
        ("zstd", b"not zstd", 400, "body: not a valid zstd frame"),
        ("gzip", b"\x1f\x8b", 415, "Content-Encoding: 'gzip' is not supported here"),
    ],
)
def test_bad_compressed_bodies_are_refused_naming_what_is_wrong(
    gateway: str, key: str, encoding: str, body: bytes, status: int, detail: str
) -> None:
    """A zstd body that inflates past QT_MAX_REQUEST_BYTES (a few KB on the wire) and one that
    is not zstd: 400 naming it; an encoding not offered: 415 naming it."""
    answer = httpx.post(
        f"{gateway}/api/v1/forward_backward",
        content=body,
        timeout=30,
        headers={
            "X-API-Key": key,
            "Content-Type": "application/x-protobuf",
            "Content-Encoding": encoding,
        },
    )
    assert answer.status_code == status and answer.json()["detail"].startswith(detail), answer.text


# --- Dimuon ----------------------------------------------------------------------------------
def test_a_dimuon_run_trains_through_the_sdk(sdk_service: tinker.ServiceClient) -> None:
    """create_lora_training_client(optimizer=DimuonOptimizerConfig()) makes a Dimuon run
    (get_info says so); DimuonParams steps lower the loss; AdamParams fail naming
    optimizer_params."""
    trainer = sdk_service.create_lora_training_client(
        base_model=TINY, rank=4, seed=9, optimizer=types.DimuonOptimizerConfig()
    ).result()
    assert trainer.get_info().optimizer_config.type == "dimuon"
    data = text_batch(4)
    first = trainer.forward(data, "cross_entropy").result(timeout=120).metrics["loss:sum"]
    for _ in range(3):
        trainer.forward_backward(data, "cross_entropy")
        trainer.optim_step(types.DimuonParams(learning_rate=0.02)).result(timeout=120)
    last = trainer.forward(data, "cross_entropy").result(timeout=120).metrics["loss:sum"]
    assert last < first
    with pytest.raises(
        tinker.RequestFailedError,
        match="optimizer_params: this run was created with the dimuon optimizer",
    ):
        trainer.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=120)


# --- server-side custom losses ---------------------------------------------------------------
@pytest.mark.parametrize("name", ["dpo", "clipped_policy", "weighted_nll"])
def test_server_side_custom_losses_match_the_client_side_path(
    sdk_service: tinker.ServiceClient, deployment: Settings, name: str
) -> None:
    """create_custom_loss uploads the loss; forward_backward_custom then runs it on the worker
    in one forward_backward op, with the loss and metrics of the same handle run client-side
    (a forward and a second pass) on an identical model."""
    fn, names = LOSSES[name]
    handle = sdk_service.create_custom_loss(fn, {"logprobs": 1, **dict.fromkeys(names, 1)}).result(
        timeout=60
    )
    assert handle.loss_id is not None and handle.loss_id.endswith(
        ":loss:" + str(int(handle.loss_id.rsplit(":", 1)[1]))
    )
    client_side = dataclasses.replace(handle, loss_id=None)
    data = sdk_loss_data(names)
    runs = [
        sdk_service.create_lora_training_client(base_model=TINY, rank=4, seed=12).result()
        for _ in range(2)
    ]
    server_out = runs[0].forward_backward_custom(data, handle).result(timeout=120)
    client_out = runs[1].forward_backward_custom(data, client_side).result(timeout=120)
    assert server_out.metrics["loss:sum"] == pytest.approx(client_out.metrics["loss:sum"], rel=1e-5)
    for key, value in client_out.metrics.items():
        if key.startswith("custom/"):
            assert server_out.metrics[key] == pytest.approx(value, rel=1e-5), key
    assert recorded_ops(deployment, runs[0].model_id, 2) == ["create_model", "forward_backward"]
    assert recorded_ops(deployment, runs[1].model_id, 3) == [
        "create_model",
        "forward",
        "forward_backward",
    ]


def sdk_loss_data(names: list[str]) -> list[types.Datum]:
    rng = np.random.default_rng(len(names))
    data = []
    for i in range(3):
        tokens = [3 + i, 4, 5, 6 + i, 7, 8, 9 + i, 10]
        n = len(tokens) - 1
        values = {
            "ref_logprobs": -rng.uniform(3, 6, n),
            "old_logprobs": -rng.uniform(4, 7, n),
            "advantages": rng.normal(size=n),
            "weights": rng.uniform(0, 1, n),
            "chosen": (np.arange(n) < n // 2),
            "rejected": (np.arange(n) >= n // 2),
        }
        inputs = {k: values[k].astype(np.float32) for k in names}
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": np.array(tokens[1:]), **inputs},
            )
        )
    return data


def test_a_disallowed_graph_is_refused_at_upload_naming_the_node(
    gateway: str, key: str, sdk_service: tinker.ServiceClient
) -> None:
    """An upload calling os.system (which the SDK itself would not trace) is refused with 400
    naming the node; nothing is stored under its id."""
    trainer = sdk_service.create_lora_training_client(base_model=TINY, rank=2, seed=1).result()
    session_id = trainer.model_id.split(":train:")[0]
    nodes = [
        {"op": "placeholder", "name": "logprobs", "target": "logprobs"},
        {
            "op": "call_function",
            "name": "system",
            "target": "os.system",
            "args": ["touch /tmp/owned"],
        },
        {
            "op": "output",
            "name": "output",
            "target": "output",
            "args": [{"tuple": [{"ref": "system"}, {"dict": {}}]}],
        },
    ]
    answer = httpx.post(
        f"{gateway}/api/v1/create_custom_loss",
        headers={"X-API-Key": key},
        timeout=30,
        json={
            "session_id": session_id,
            "custom_loss_seq_id": 99,
            "name": "evil",
            "inputs": [{"name": "logprobs", "rank": 1}],
            "graph": {"format": 1, "nodes": nodes},
        },
    )
    assert answer.status_code == 400
    assert answer.json()["detail"].startswith(
        "graph.nodes[1] ('system'): calls 'os.system', which is not an allowed function"
    )


# --- OpenAI-compatible inference -------------------------------------------------------------
def greedy_text(sampler: Any, tokenizer: Any, prompt: list[int], max_tokens: int) -> str:
    result = sampler.sample(
        types.ModelInput.from_ints(prompt),
        1,
        types.SamplingParams(max_tokens=max_tokens, temperature=0.0),
    ).result(timeout=120)
    return str(tokenizer.decode(result.sequences[0].tokens, skip_special_tokens=True))


def test_openai_completions_and_chat_sample_like_the_sdk(
    gateway: str, key: str, sdk_service: tinker.ServiceClient
) -> None:
    """The openai client against /oai/api/v1 (API key as bearer): a greedy completion and a
    chat completion (through the tokenizer's chat template) of the base model, and a
    completion of a trained checkpoint's sampler weights, each the text the SDK samples."""
    client = openai.OpenAI(base_url=f"{gateway}/oai/api/v1", api_key=key, max_retries=0)
    trainer = sdk_service.create_lora_training_client(base_model=TINY, rank=4, seed=2).result()
    tokenizer = trainer.get_tokenizer()
    prompt = "Question: What is 2+2?\nAnswer:"
    base = sdk_service.create_sampling_client(base_model=TINY).result()

    completion = client.completions.create(model=TINY, prompt=prompt, max_tokens=6, temperature=0)
    assert completion.choices[0].text == greedy_text(base, tokenizer, tokenizer.encode(prompt), 6)
    assert completion.usage is not None and completion.usage.prompt_tokens == len(
        tokenizer.encode(prompt)
    )

    messages = [{"role": "user", "content": "What is 2+2?"}]
    chat = client.chat.completions.create(
        model=TINY,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=6,
        temperature=0,
    )
    templated = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == greedy_text(
        base, tokenizer, tokenizer.encode(templated), 6
    )

    batch = [text_datum_of(tokenizer, prompt, " 4\n")]
    for _ in range(3):
        trainer.forward_backward(batch, "cross_entropy")
        trainer.optim_step(types.AdamParams(learning_rate=5e-2))
    path = trainer.save_weights_for_sampler("oai").result(timeout=120).path
    tuned = client.completions.create(model=path, prompt=prompt, max_tokens=6, temperature=0)
    sampler = sdk_service.create_sampling_client(model_path=path).result()
    assert tuned.choices[0].text == greedy_text(sampler, tokenizer, tokenizer.encode(prompt), 6)


def text_datum_of(tokenizer: Any, prompt: str, completion: str) -> types.Datum:
    prompt_tokens = tokenizer.encode(prompt)
    tokens = prompt_tokens + tokenizer.encode(completion)
    weights = [0.0] * (len(prompt_tokens) - 1) + [1.0] * (len(tokens) - len(prompt_tokens))
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": np.array(tokens[1:], dtype=np.int64),
            "weights": np.array(weights, dtype=np.float32),
        },
    )


def test_openai_routes_refuse_a_bad_key_and_another_tenants_checkpoint(
    gateway: str, key: str, deployment: Settings
) -> None:
    """No valid bearer key: 401. A checkpoint path of another tenant reads as no checkpoint:
    400 naming model."""
    bad = openai.OpenAI(base_url=f"{gateway}/oai/api/v1", api_key="tml-nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=TINY, prompt="hi", max_tokens=2)
    stranger = openai.OpenAI(
        base_url=f"{gateway}/oai/api/v1",
        max_retries=0,
        api_key=make_key(deployment, "oai-stranger"),
    )
    with pytest.raises(openai.BadRequestError, match="model: no checkpoint"):
        stranger.completions.create(
            model="tinker://sess-x:train:0/sampler_weights/a", prompt="hi", max_tokens=2
        )


def served_row(area: str) -> tuple[set[str], set[str]]:
    """The backticked names of one row of docs/tinker-http-protocol.md section 12.5's table:
    (served, refused)."""
    text = (REPO / "docs" / "tinker-http-protocol.md").read_text()
    section = text.split("### 12.5 ", 1)[1].split("\n## ", 1)[0]
    row = next(line for line in section.splitlines() if line.startswith(f"| {area} "))
    _, served, refused = (cell.strip() for cell in row.strip("|").split("|"))
    return set(re.findall(r"`([^`]+)`", served)), set(re.findall(r"`([^`]+)`", refused))


def test_the_protocol_doc_s_served_table_is_what_the_gateway_serves() -> None:
    """Section 12.5 says which loss functions and sample options are served: exactly the
    losses the worker runs and the options the gateway's asample takes (none refused)."""
    from queue_tinker.gateway.tinker.bodies import SampleRequest
    from queue_tinker.types.enums import LossFn

    losses, _ = served_row("Loss functions (`loss_fn`)")
    assert losses == {loss.value for loss in LossFn}
    options, refused = served_row("Sample options")
    core = {"sampling_session_id", "seq_id", "num_samples", "prompt", "sampling_params", "type"}
    assert options == set(SampleRequest.model_fields) - core
    assert not refused


def test_openai_routes_take_the_key_as_a_bearer_token_or_as_x_api_key(
    gateway: str, key: str
) -> None:
    """The key the other routes take in X-API-Key works here too (a load generator sends it
    that way), as does the bearer token the openai client sends; with neither, 401 names both."""
    body = {"model": TINY, "prompt": "hi", "max_tokens": 2, "temperature": 0.0}
    url = f"{gateway}/oai/api/v1/completions"
    with httpx.Client(timeout=120) as http:
        by_header = http.post(url, json=body, headers={"X-API-Key": key})
        by_bearer = http.post(url, json=body, headers={"Authorization": f"Bearer {key}"})
        neither = http.post(url, json=body)
        wrong = http.post(url, json=body, headers={"X-API-Key": "tml-nope"})
    assert by_header.status_code == by_bearer.status_code == 200, by_header.text
    assert by_header.json()["choices"][0]["text"] == by_bearer.json()["choices"][0]["text"]
    assert neither.status_code == 401
    assert "Authorization: Bearer" in neither.text and "X-API-Key" in neither.text
    assert wrong.status_code == 401


# --- published checkpoints -------------------------------------------------------------------
def test_a_published_checkpoint_is_readable_by_every_tenant(
    gateway: str, key: str, deployment: Settings, sdk_service: tinker.ServiceClient
) -> None:
    """Another tenant cannot sample from or load a checkpoint until its owner publishes it;
    then it can (listings say public), nobody but the owner can publish it, and after
    unpublishing it is refused again."""
    trainer = sdk_service.create_lora_training_client(base_model=TINY, rank=2, seed=6).result()
    state = trainer.save_state("pub").result(timeout=120).path
    weights = trainer.save_weights_for_sampler("pub").result(timeout=120).path
    owner = tinker.RestClient(base_url=gateway, api_key=key)
    other_key = make_key(deployment, f"pub-{uuid.uuid4().hex[:6]}")
    with sdk_client(gateway, other_key) as other:
        with pytest.raises(tinker.BadRequestError, match="no checkpoint"):
            other.create_sampling_client(model_path=weights).result()
        stranger = tinker.RestClient(base_url=gateway, api_key=other_key)
        with pytest.raises(tinker.NotFoundError):
            stranger.publish_checkpoint_from_tinker_path(weights).result()

        for path in (state, weights):
            owner.publish_checkpoint_from_tinker_path(path).result()
        listed = wait_for(
            lambda: [
                c for c in owner.list_checkpoints(trainer.model_id).result().checkpoints if c.public
            ]
        )
        assert sorted(c.tinker_path for c in listed) == sorted([state, weights])
        sampled = (
            other.create_sampling_client(model_path=weights)
            .result()
            .sample(types.ModelInput.from_ints([3, 4]), 1, types.SamplingParams(max_tokens=2))
        )
        assert len(sampled.result(timeout=120).sequences) == 1
        copy = other.create_training_client_from_state(state).result()
        assert copy.forward(text_batch(1), "cross_entropy").result(timeout=120).metrics

        owner.unpublish_checkpoint_from_tinker_path(weights).result()
        with pytest.raises(tinker.BadRequestError, match="no checkpoint"):
            other.create_sampling_client(model_path=weights).result()
