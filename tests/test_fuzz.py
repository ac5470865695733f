"""Malformed requests, generated with hypothesis, through the Python client and through the
gateway's raw HTTP (protobuf and JSON bodies), against a real LoRA worker and gateway.

Every one gets a clear user error that names a field: the client raises UserInputError or its
future RequestFailedError(category user); the gateway answers 400/404/413/422 with a detail
naming the field, or takes the request and retrieve_future reports the worker's user error.
Never a 500, never a hang. Afterwards the same worker process still serves, and a control
model trained before the fuzz gives bit-for-bit the same logprobs, as does one trained the same
way after it.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
import pytest
import redis
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from procs import lora_deployment, make_key
from tinker.proto import tinker_public_pb2 as pb

from queue_tinker.client import SamplingClient, ServiceClient, TrainingClient
from queue_tinker.errors import ErrorCategory, RequestFailedError, UserInputError
from queue_tinker.queue.keys import Keys
from queue_tinker.settings import Settings
from queue_tinker.types import AdamParams, Datum, LossFn, ModelInput

TINY = "queue-tinker/tiny-llama"
VOCAB = 259  # the tiny model's: 256 bytes + 3 specials
TOKENS, DATUMS, SAMPLES, BYTES = 48, 6, 4, 32 * 1024  # small, so oversize requests are cheap
LIMITS = {
    "max_tokens_per_datum": TOKENS,
    "max_datums_per_request": DATUMS,
    "max_samples_per_request": SAMPLES,
    "max_request_bytes": BYTES,
}
# ~60 s for the module on 2 cores: most examples are refused in milliseconds, the rest cost
# one tiny op on the worker.
FUZZ = settings(
    max_examples=200,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
RESULT_TIMEOUT_S = 30  # a result slower than this is a hang
CONTROL_SEED = 11


# --- the deployment ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def deployment(redis_url: str, database_url: str) -> Iterator[Settings]:
    with lora_deployment(redis_url, database_url, TINY, **LIMITS) as settings_:
        yield settings_


@pytest.fixture(scope="module")
def service(deployment: Settings) -> Iterator[ServiceClient]:
    client = ServiceClient(deployment)
    yield client
    client.close()


def worker(settings_: Settings) -> tuple[str, int]:
    """The deployment's one registered worker: its id and pid."""
    client = redis.Redis.from_url(settings_.redis_url or "", decode_responses=True)
    try:
        keys = Keys(settings_.key_prefix)
        [worker_id] = client.zrange(keys.workers(), 0, -1)
        return worker_id, int(client.hget(keys.worker(worker_id), "pid"))  # type: ignore[arg-type]
    finally:
        client.close()


# --- the control model -------------------------------------------------------------------------
CONTROL = [
    Datum(
        model_input=ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": np.array(tokens[1:])},
    )
    for tokens in (
        [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100],
        [50, 43, 50, 61, 52, 10, 51, 43, 51, 61, 54, 10],
    )
]


def train_control(service: ServiceClient) -> TrainingClient:
    model = service.create_lora_training_client(TINY, rank=4, seed=CONTROL_SEED)
    for _ in range(3):
        model.forward_backward(CONTROL, "cross_entropy")
        model.optim_step(AdamParams(learning_rate=0.05))
    return model


def control_logprobs(model: TrainingClient) -> tuple[list[np.ndarray], float]:
    out = model.forward(CONTROL, "cross_entropy").result(RESULT_TIMEOUT_S)
    return [o["logprobs"].data for o in out.loss_fn_outputs], out.loss


@dataclass
class Control:
    model: TrainingClient
    logprobs: list[np.ndarray]
    loss: float
    worker: tuple[str, int]


@pytest.fixture(scope="module")
def control(service: ServiceClient, deployment: Settings) -> Control:
    """Trained before any fuzz test runs (each asks for it); compared after the last one."""
    model = train_control(service)
    return Control(model, *control_logprobs(model), worker=worker(deployment))


# --- what a malformed request is -----------------------------------------------------------------
@dataclass
class BadBatch:
    data: Any
    loss_fn: Any
    config: Any
    field: str  # a regex: the field the error must name first


@dataclass
class BadAdam:
    params: Any
    field: str


@dataclass
class BadSample:
    prompt: Any
    num_samples: Any
    params: Any
    field: str


# Text that no lax parser reads as a number or a bool ("1", "inf", "true" would be valid).
WORDS = st.text(alphabet="abcxyz", min_size=1, max_size=4)
SCALAR_JUNK = st.one_of(st.none(), st.integers(-5, 5), WORDS)
JUNK = st.one_of(
    SCALAR_JUNK,
    st.lists(st.integers(0, 9), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
NON_FINITE = st.sampled_from([math.nan, math.inf, -math.inf])
HUGE_INT = st.one_of(st.integers(2**64, 2**80), st.integers(-(2**80), -(2**63) - 1))
OUT_OF_VOCAB = st.one_of(
    st.integers(VOCAB, 2**31 - 1),
    st.integers(-(2**31), -1),
    st.integers(2**31, 2**63 - 1),
    HUGE_INT,
)
POLICY_LOSSES = ["importance_sampling", "ppo", "cispo", "dro", "gspo", "stable_reinforce"]
CLIPPED_LOSSES = ["ppo", "cispo", "gspo"]


def tokens_of(n: int) -> st.SearchStrategy[list[int]]:
    return st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n)


def datum_json(tokens: list[int], **inputs: Any) -> dict[str, Any]:
    """A datum in the JSON wire form (the Python client takes it too): position i of
    `tokens[:-1]` predicts `tokens[i + 1]`."""
    loss_inputs = {"target_tokens": {"data": tokens[1:], "dtype": "int64"}}
    loss_inputs.update(inputs)
    return {"model_input": {"chunks": [{"tokens": tokens[:-1]}]}, "loss_fn_inputs": loss_inputs}


@st.composite
def good_datums(draw: st.DrawFn, size: int | None = None) -> list[dict[str, Any]]:
    count = draw(st.integers(1, 3)) if size is None else size
    return [datum_json(draw(tokens_of(draw(st.integers(3, 9))))) for _ in range(count)]


def floats_json(values: list[float]) -> dict[str, Any]:
    return {"data": values, "dtype": "float32"}


@st.composite
def bad_batches(draw: st.DrawFn) -> BadBatch:  # noqa: C901 - a table of malformations
    data = draw(good_datums())
    i = draw(st.integers(0, len(data) - 1))
    at = rf"data\[{i}\]"
    n = len(data[i]["model_input"]["chunks"][0]["tokens"])
    kind = draw(
        st.sampled_from(
            [
                "empty",
                "too_many",
                "too_long",
                "input_vocab",
                "target_vocab",
                "non_finite",
                "lengths",
                "target_too_long",
                "no_tokens",
                "no_target",
                "unknown_input",
                "two_d",
                "junk_datum",
                "junk_field",
                "junk_data",
                "loss_fn",
                "config",
                "policy_config",
            ]
        )
    )
    loss_fn, config, field = "cross_entropy", None, at
    if kind == "empty":
        data, field = [], "data"
    elif kind == "too_many":
        data, field = draw(good_datums(size=DATUMS + draw(st.integers(1, 3)))), "data"
    elif kind == "too_long":
        data[i] = datum_json(draw(tokens_of(TOKENS + draw(st.integers(2, 6)))))
    elif kind == "input_vocab":
        data[i]["model_input"]["chunks"][0]["tokens"][draw(st.integers(0, n - 1))] = draw(
            OUT_OF_VOCAB
        )
    elif kind == "target_vocab":
        data[i]["loss_fn_inputs"]["target_tokens"]["data"][draw(st.integers(0, n - 1))] = draw(
            OUT_OF_VOCAB
        )
    elif kind == "non_finite":
        loss_fn = draw(st.sampled_from(["cross_entropy", *POLICY_LOSSES]))
        config = {"beta": 0.1} if loss_fn == "dro" else None
        keys = ["weights"] if loss_fn == "cross_entropy" else ["logprobs", "advantages"]
        for datum in data:
            for key in keys:
                datum["loss_fn_inputs"][key] = floats_json(
                    [0.5] * len(datum["model_input"]["chunks"][0]["tokens"])
                )
        key = draw(st.sampled_from(keys))
        data[i]["loss_fn_inputs"][key]["data"][draw(st.integers(0, n - 1))] = draw(NON_FINITE)
        field = rf"{at}\.loss_fn_inputs\['{key}'\]"
    elif kind == "lengths":
        data[i]["loss_fn_inputs"]["weights"] = floats_json(
            [1.0] * (n + draw(st.sampled_from([-2, -1, 1, 3])))
        )
        field = rf"{at}\.loss_fn_inputs"
    elif kind == "target_too_long":
        tokens = data[i]["model_input"]["chunks"][0]["tokens"]
        data[i]["loss_fn_inputs"]["target_tokens"]["data"] = tokens + [5] * draw(st.integers(1, 3))
        field = rf"{at}\.loss_fn_inputs\['target_tokens'\]"
    elif kind == "no_tokens":
        data[i] = {
            "model_input": {"chunks": []},
            "loss_fn_inputs": {"target_tokens": {"data": [], "dtype": "int64"}},
        }
        field = rf"{at}\.model_input"
    elif kind == "no_target":
        data[i]["loss_fn_inputs"] = draw(st.sampled_from([{}, {"weights": floats_json([1.0])}]))
        field = rf"{at}\.loss_fn_inputs"
    elif kind == "unknown_input":
        name = draw(
            st.text("abcdefgh_", min_size=1, max_size=8).filter(
                lambda s: s not in ("weights", "target_tokens")
            )
        )
        data[i]["loss_fn_inputs"][name] = floats_json([1.0] * n)
        field = rf"{at}\.loss_fn_inputs"
    elif kind == "two_d":
        targets = data[i]["loss_fn_inputs"]["target_tokens"]["data"]
        data[i]["loss_fn_inputs"]["target_tokens"] = {"data": [targets, targets], "dtype": "int64"}
        field = rf"{at}\.loss_fn_inputs"
    elif kind == "junk_datum":
        data[i] = draw(JUNK)
    elif kind == "junk_field":
        where = draw(
            st.sampled_from(["model_input", "chunks", "tokens", "target", "dtype", "extra"])
        )
        bad = draw(
            st.one_of(SCALAR_JUNK, st.just([{"a": 1}]), st.just(["x"]), st.just([[1, 2], [3]]))
        )
        if where == "model_input":
            data[i]["model_input"] = bad
        elif where == "chunks":
            data[i]["model_input"]["chunks"] = bad
        elif where == "tokens":  # one bad token (a lone valid one still mismatches the target)
            data[i]["model_input"]["chunks"][0]["tokens"] = bad if isinstance(bad, list) else [bad]
        elif where == "target":
            data[i]["loss_fn_inputs"]["target_tokens"]["data"] = bad
        elif where == "dtype":
            data[i]["loss_fn_inputs"]["target_tokens"]["dtype"] = draw(
                st.sampled_from(["int32", "complex64", "", "float16"])
            )
        else:
            data[i]["surprise"] = bad
    elif kind == "junk_data":
        data, field = (
            draw(
                st.one_of(
                    st.none(), st.integers(), st.text(max_size=4), st.just({"model_input": {}})
                )
            ),
            "data",
        )
    elif kind == "loss_fn":
        loss_fn = draw(
            st.one_of(st.text(max_size=12), st.integers(), st.none()).filter(
                lambda v: v not in {f.value for f in LossFn}
            )
        )
        field = "loss_fn"
    elif kind == "config":
        config = draw(
            st.one_of(
                st.dictionaries(
                    st.text("xyz", min_size=1, max_size=4), st.floats(), min_size=1, max_size=2
                ),
                st.just("not a dict"),
                st.just([1.0]),
            )
        )
        field = "loss_fn_config"
    else:  # policy_config
        loss_fn = draw(st.sampled_from(["dro", "stable_reinforce", *CLIPPED_LOSSES]))
        for datum in data:
            m = len(datum["model_input"]["chunks"][0]["tokens"])
            datum["loss_fn_inputs"]["logprobs"] = floats_json([-1.0] * m)
            datum["loss_fn_inputs"]["advantages"] = floats_json([0.5] * m)
        if loss_fn == "dro":
            config = {"beta": draw(st.one_of(st.floats(max_value=-1e-6), NON_FINITE, WORDS))}
        elif loss_fn == "stable_reinforce":  # takes no config: any key is refused
            config = {draw(st.sampled_from(["beta", "clip_high_threshold"])): 1.0}
        else:
            key = draw(st.sampled_from(["clip_low_threshold", "clip_high_threshold"]))
            bad_value = st.one_of(
                NON_FINITE,
                WORDS,
                st.floats(max_value=-1e-6)
                if key == "clip_low_threshold"
                else st.floats(min_value=0, max_value=0.999),
            )
            if key == "clip_low_threshold":
                bad_value = st.one_of(bad_value, st.floats(min_value=1.001, max_value=1e6))
            config = {key: draw(bad_value)}
        field = "loss_fn_config"
    return BadBatch(data, loss_fn, config, field)


ADAM_KEYS = ["learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm"]


@st.composite
def bad_adams(draw: st.DrawFn) -> BadAdam:
    params: dict[str, Any] = {"learning_rate": 1e-3}
    kind = draw(st.sampled_from(["value", "type", "unknown", "whole"]))
    if kind == "whole":
        return BadAdam(
            draw(
                st.one_of(st.integers(), st.text(max_size=5), st.lists(st.integers(), max_size=2))
            ),
            "adam_params",
        )
    if kind == "unknown":
        params[draw(st.sampled_from(["momentum", "lr", "betas", "amsgrad"]))] = 0.9
        return BadAdam(params, "adam_params")
    key = draw(st.sampled_from(ADAM_KEYS))
    if kind == "type":
        params[key] = draw(
            st.one_of(
                WORDS,
                st.lists(st.floats(), max_size=2),
                st.dictionaries(st.text(max_size=2), st.floats(), max_size=1),
            )
        )
    elif key in ("beta1", "beta2"):
        params[key] = draw(
            st.one_of(st.floats(min_value=1), st.floats(max_value=-1e-9), NON_FINITE)
        )
    elif key == "eps":
        params[key] = draw(st.one_of(st.floats(max_value=0), NON_FINITE))
    else:
        params[key] = draw(st.one_of(st.floats(max_value=-1e-9), NON_FINITE))
    return BadAdam(params, "adam_params")


def prompt_json(tokens: Any) -> dict[str, Any]:
    return {"chunks": [{"tokens": tokens}]}


@st.composite
def bad_samples(draw: st.DrawFn) -> BadSample:  # noqa: C901 - a table of malformations
    tokens = draw(tokens_of(draw(st.integers(1, 6))))
    prompt: Any = prompt_json(tokens)
    num_samples: Any = 1
    params: dict[str, Any] | Any = {"max_tokens": 2, "temperature": 0.0}
    kind = draw(
        st.sampled_from(
            [
                "prompt_empty",
                "prompt_long",
                "prompt_vocab",
                "prompt_junk",
                "num_samples",
                "max_tokens",
                "temperature",
                "top_p",
                "top_k",
                "stop",
                "stop_vocab",
                "seed",
                "unknown_param",
                "params_junk",
            ]
        )
    )
    field = "sampling_params"
    if kind == "prompt_empty":
        prompt, field = draw(st.sampled_from([{"chunks": []}, prompt_json([])])), "prompt"
    elif kind == "prompt_long":
        prompt, field = prompt_json(draw(tokens_of(TOKENS + draw(st.integers(1, 5))))), "prompt"
    elif kind == "prompt_vocab":
        tokens[draw(st.integers(0, len(tokens) - 1))] = draw(OUT_OF_VOCAB)
        field = "prompt"
    elif kind == "prompt_junk":
        prompt = draw(
            st.one_of(
                st.integers(),
                st.text(max_size=4),
                st.just({"chunks": "x"}),
                st.just(prompt_json(["a"])),
                st.just(prompt_json(None)),
            )
        )
        field = "prompt"
    elif kind == "num_samples":
        num_samples = draw(
            st.one_of(
                st.integers(max_value=0), st.integers(SAMPLES + 1, 10**30), WORDS, st.just(1.5)
            )
        )
        field = "num_samples"
    elif kind == "max_tokens":
        params["max_tokens"] = draw(
            st.one_of(st.integers(max_value=0), st.integers(TOKENS + 1, 10**30), WORDS)
        )
    elif kind == "temperature":
        params["temperature"] = draw(st.one_of(st.floats(max_value=-1e-9), NON_FINITE, WORDS))
    elif kind == "top_p":
        params["top_p"] = draw(
            st.one_of(st.floats(max_value=0), st.floats(min_value=1.0001), NON_FINITE)
        )
    elif kind == "top_k":
        params["top_k"] = draw(st.one_of(st.just(0), st.integers(max_value=-2)))
    elif kind == "stop":
        params["stop"] = draw(
            st.one_of(
                st.just([""]),
                st.just([1, "a"]),
                st.lists(st.integers(max_value=-1), min_size=1, max_size=2),
                st.just(["s"] * 33),
                st.just(5),
            )
        )
    elif kind == "stop_vocab":
        params["stop"] = [draw(st.integers(VOCAB, 2**31 - 1))]
    elif kind == "seed":
        params["seed"] = draw(st.one_of(HUGE_INT, WORDS, st.just(1.5)))
    elif kind == "unknown_param":
        params[draw(st.sampled_from(["beam_width", "n", "logprobs"]))] = 2
    else:
        params = draw(
            st.one_of(st.integers(), st.text(max_size=4), st.lists(st.integers(), max_size=2))
        )
    return BadSample(prompt, num_samples, params, field)


# --- checking the answers ------------------------------------------------------------------------
def names(field: str, message: str, *, prefix: str = "") -> bool:
    """Whether an error message starts by naming the field (after an optional prefix, such as
    the JSON envelope's `forward_input.`)."""
    return re.match(rf"^(?:{prefix})?(?:{field})(?:\[|\.|:|\s)", message) is not None


def client_error(call: Callable[[], Any], field: str, what: Any) -> None:
    """The call is refused at once (UserInputError) or its future fails as the user's error;
    either way the message names `field`."""
    try:
        future = call()
    except UserInputError as exc:
        event("refused by the client")
        message = exc.message
    else:
        try:
            outcome = future.result(RESULT_TIMEOUT_S)
        except RequestFailedError as exc:
            assert exc.category is ErrorCategory.USER, (what, str(exc), exc.detail)
            event("failed on the worker")
            message = exc.message
        else:
            pytest.fail(f"accepted a malformed request: {what!r} -> {outcome!r}")
    assert names(field, message), (what, field, message)


# --- the Python client ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trainer(service: ServiceClient) -> TrainingClient:
    return service.create_lora_training_client(TINY, rank=4, seed=3)


@pytest.fixture(scope="module")
def sampler(service: ServiceClient) -> SamplingClient:
    return service.create_sampling_client(base_model=TINY)


@st.composite
def client_only(draw: st.DrawFn) -> tuple[str, Any, str]:
    """Calls only the Python client has: (method, argument, field)."""
    kind = draw(
        st.sampled_from(
            [
                "ping_big",
                "ping_delay",
                "save_name",
                "save_ttl",
                "load_path",
                "load_missing",
                "model_id",
                "model_path",
            ]
        )
    )
    if kind == "ping_big":
        return kind, b"x" * draw(st.integers(BYTES, 2 * BYTES)), "request"
    if kind == "ping_delay":
        return (
            kind,
            draw(st.one_of(st.integers(max_value=-1), st.integers(60_001, 10**9), WORDS)),
            "delay_ms",
        )
    if kind == "save_name":
        name = draw(
            st.one_of(st.text(max_size=6), st.integers(), st.none()).filter(
                lambda s: not (isinstance(s, str) and re.fullmatch(r"[A-Za-z0-9][\w.-]*", s))
            )
        )
        return kind, name, "name"
    if kind == "save_ttl":
        return kind, draw(st.one_of(st.integers(max_value=0), WORDS, st.just(1.5))), "ttl_seconds"
    if kind == "load_path":
        return (
            kind,
            draw(
                st.one_of(
                    st.text(max_size=12), st.just("tinker://"), st.just("tinker://m-x/nope/y")
                )
            ),
            "path",
        )
    if kind == "load_missing":
        return kind, f"tinker://m-{uuid.uuid4().hex}/weights/never-saved", "path"
    if kind == "model_id":
        return kind, draw(st.text(min_size=1, max_size=10)), "model_id"
    return kind, f"tinker://m-{uuid.uuid4().hex}/sampler_weights/x", "model_path"


def client_call(
    service: ServiceClient, trainer: TrainingClient, kind: str, arg: Any
) -> Callable[[], Any]:
    return {
        "ping_big": lambda: trainer.ping(arg),
        "ping_delay": lambda: trainer.ping(delay_ms=arg),
        "save_name": lambda: trainer.save_state(arg),
        "save_ttl": lambda: trainer.save_state("fuzz-ttl", ttl_seconds=arg),
        "load_path": lambda: trainer.load_state(arg),
        "load_missing": lambda: trainer.load_state(arg),
        "model_id": lambda: service.training_client(arg),
        "model_path": lambda: service.create_sampling_client(model_path=arg),
    }[kind]


@FUZZ
@given(
    case=st.one_of(bad_batches(), bad_adams(), bad_samples(), client_only()),
    forward_only=st.booleans(),
)
def test_the_python_client_answers_malformed_requests_with_user_errors(
    service: ServiceClient,
    trainer: TrainingClient,
    sampler: SamplingClient,
    control: Control,
    case: Any,
    forward_only: bool,
) -> None:
    if isinstance(case, BadBatch):
        method = trainer.forward if forward_only else trainer.forward_backward
        client_error(lambda: method(case.data, case.loss_fn, case.config), case.field, case)
    elif isinstance(case, BadAdam):
        client_error(lambda: trainer.optim_step(case.params), case.field, case)
    elif isinstance(case, BadSample):
        client_error(
            lambda: sampler.sample(case.prompt, case.num_samples, case.params), case.field, case
        )
    else:
        kind, arg, field = case
        client_error(client_call(service, trainer, kind, arg), field, case)


# --- the gateway ------------------------------------------------------------------------------
class Wire:
    """Raw protocol calls, as test_gateway_sdk's: JSON, protobuf or any bytes at all."""

    def __init__(self, gateway: str, key: str, settings_: Settings) -> None:
        self.http = httpx.Client(
            base_url=gateway + "/api/v1", headers={"X-API-Key": key}, timeout=RESULT_TIMEOUT_S
        )
        self.redis = redis.Redis.from_url(settings_.redis_url or "")
        self.keys = Keys(settings_.key_prefix)
        self.sample_seq = itertools.count()

    def post(self, endpoint: str, **body: Any) -> httpx.Response:
        """JSON as Python writes it: NaN and Infinity included (httpx's json= refuses them)."""
        return self.http.post(
            endpoint, content=json.dumps(body), headers={"Content-Type": "application/json"}
        )

    def next_seq_id(self, model_id: str) -> int:
        """The seq_id the model's order waits for (a refused request may or may not have
        used its own, depending on where it was refused)."""
        return int(self.redis.hget(self.keys.model_meta(model_id), "next_seq_id") or 1)

    def result(self, request_id: str) -> dict[str, Any]:
        deadline = time.monotonic() + RESULT_TIMEOUT_S
        while True:
            response = self.http.post(
                "/retrieve_future",
                json={"request_id": request_id},
                headers={"X-Stainless-Read-Timeout": "10"},
            )
            assert response.status_code == 200, response.text
            answer: dict[str, Any] = response.json()
            if answer.get("type") != "try_again":
                return answer
            assert time.monotonic() < deadline, f"request {request_id} hangs: {answer}"

    def close(self) -> None:
        self.http.close()
        self.redis.close()


@dataclass
class Target:
    wire: Wire
    session: str
    model: str
    sampler: str


@pytest.fixture(scope="module")
def target(gateway: str, deployment: Settings) -> Iterator[Target]:
    wire = Wire(gateway, make_key(deployment, f"fuzz-{uuid.uuid4().hex[:8]}"), deployment)
    session = wire.post("/create_session").json()["session_id"]
    created = wire.post(
        "/create_model",
        session_id=session,
        model_seq_id=0,
        base_model=TINY,
        lora_config={"rank": 4},
    ).json()
    assert wire.result(created["request_id"])["model_id"] == created["model_id"]
    sampler = wire.post(
        "/create_sampling_session", session_id=session, sampling_session_seq_id=0, base_model=TINY
    ).json()
    yield Target(wire, session, created["model_id"], sampler["sampling_session_id"])
    wire.close()


def gateway_error(
    wire: Wire, response: httpx.Response, field: str, what: Any, prefix: str = ""
) -> None:
    """A 4xx whose detail names the field, or a request taken (200) whose result is the
    worker's user error naming it. Never a 500."""
    status = response.status_code
    assert status in (200, 400, 404, 413, 422), (what, status, response.text[:2000])
    event(f"HTTP {status}" if status != 200 else "failed on the worker")
    if status == 200:
        answer = wire.result(response.json()["request_id"])
        assert answer.get("category") == "user", (what, answer)
        message = answer["error"]
    else:
        detail = response.json()["detail"]
        if status == 422:  # FastAPI's own validation: the field is in each error's loc
            locs = [[str(part) for part in error["loc"]] for error in detail]
            assert any(re.fullmatch(field, part) for loc in locs for part in loc), (
                what,
                field,
                detail,
            )
            return
        # FastAPI's answer to a body its JSON parser gave up on (too deeply nested).
        message = {"There was an error parsing the body": "body: unparsable"}.get(detail, detail)
    assert names(field, message, prefix=prefix), (what, field, message)


def proto_batch(model_id: str, seq_id: int, case: BadBatch, forward_only: bool) -> bytes | None:
    """The case as the SDK's protobuf, where protobuf can carry it (else None: JSON only)."""
    request = pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, forward_only=forward_only)
    try:
        request.loss_fn = case.loss_fn
        for key, value in (case.config or {}).items():
            if isinstance(value, bool):
                return None
            request.loss_fn_config[key] = value
        for datum in case.data:
            item = request.data.add()
            for chunk in datum["model_input"]["chunks"]:
                tokens = np.array(chunk["tokens"], dtype=np.int64)
                if tokens.ndim != 1 or np.any(tokens != tokens.astype("<i4")):
                    return None
                item.model_input.add().encoded_text.tokens = tokens.astype("<i4").tobytes()
            for key, tensor in datum["loss_fn_inputs"].items():
                wire_dtype, dtype = {
                    "int64": ("<i8", pb.DTYPE_INT64),
                    "float32": ("<f4", pb.DTYPE_FLOAT32),
                }[tensor["dtype"]]
                array = np.array(tensor["data"], dtype=wire_dtype)
                if array.ndim == 0:  # no shape on the wire means 1-D: a scalar is [scalar]
                    return None
                out = item.loss_fn_inputs[key]
                out.dense, out.dtype = array.tobytes(), dtype
                out.shape[:] = list(array.shape)
            if set(datum) - {"model_input", "loss_fn_inputs"}:
                return None
    except (TypeError, ValueError, KeyError, OverflowError, AttributeError):
        return None  # not representable: a wrong type, a number past int64, ...
    return request.SerializeToString()


ENVELOPE = r"(?:forward_input|forward_backward_input)\."
PROTOBUF = {"Content-Type": "application/x-protobuf"}


# Found by the fuzzer: a scalar target (a 0-d tensor) is JSON only; protobuf would carry it
# as the valid [0].
SCALAR_TARGET = BadBatch(
    data=[
        {
            "model_input": {"chunks": [{"tokens": [0, 0]}]},
            "loss_fn_inputs": {"target_tokens": {"data": 0, "dtype": "int64"}},
        }
    ],
    loss_fn="cross_entropy",
    config=None,
    field=r"data\[0\]",
)


@FUZZ
@given(case=bad_batches(), forward_only=st.booleans(), as_proto=st.booleans())
@example(case=SCALAR_TARGET, forward_only=False, as_proto=True)
def test_the_gateway_answers_malformed_training_batches_with_user_errors(
    target: Target, control: Control, case: BadBatch, forward_only: bool, as_proto: bool
) -> None:
    wire, model = target.wire, target.model
    seq_id = wire.next_seq_id(model)
    body = proto_batch(model, seq_id, case, forward_only) if as_proto else None
    if body is not None:
        response = wire.http.post("/forward_backward", content=body, headers=PROTOBUF)
        gateway_error(wire, response, case.field, case)
        return
    envelope = "forward_input" if forward_only else "forward_backward_input"
    batch = {"data": case.data, "loss_fn": case.loss_fn, "loss_fn_config": case.config}
    response = wire.http.post(
        "/forward" if forward_only else "/forward_backward",
        content=json.dumps({"model_id": model, "seq_id": seq_id, envelope: batch}),
        headers={"Content-Type": "application/json"},
    )
    gateway_error(wire, response, case.field, case, prefix=ENVELOPE)


@st.composite
def bad_envelopes(draw: st.DrawFn) -> tuple[str, Any, str]:  # noqa: C901 - a table of cases
    """Requests broken outside their batch: (kind, argument, field)."""
    kind = draw(
        st.sampled_from(
            [
                "garbage_proto",
                "json_as_proto",
                "proto_as_json",
                "form",
                "not_json",
                "deep_json",
                "not_an_object",
                "missing",
                "seq_id",
                "huge_seq_id",
                "unknown_model",
                "unknown_sampler",
                "unknown_request",
                "unknown_session",
                "lora_config",
                "oversize",
                "sparse_bomb",
                "dtype",
                "token_bytes",
                "save_path",
                "load_path",
                "topk",
            ]
        )
    )
    if kind == "garbage_proto":
        return kind, draw(st.binary(max_size=64)), "body|model_id|seq_id"
    if kind == "json_as_proto":
        return kind, json.dumps({"model_id": "x", "seq_id": 1}).encode(), "body|model_id"
    if kind in ("proto_as_json", "not_json"):
        return (
            kind,
            draw(st.binary(min_size=1, max_size=32).filter(lambda b: not _is_json(b))),
            "body",
        )
    if kind == "form":
        return kind, draw(st.sampled_from(["/optim_step", "/asample", "/save_weights"])), "body"
    if kind == "deep_json":
        return kind, draw(st.sampled_from(["/forward", "/optim_step"])), "body"  # 20 KB
    if kind == "not_an_object":
        endpoint = draw(st.sampled_from(["/forward", "/optim_step", "/asample", "/get_info"]))
        return (
            kind,
            (
                endpoint,
                draw(
                    st.one_of(
                        st.integers(),
                        st.lists(st.integers(), max_size=2),
                        st.text(max_size=3),
                        st.none(),
                    )
                ),
            ),
            "body",
        )
    if kind == "missing":
        endpoint, fields = draw(
            st.sampled_from(
                [
                    ("/optim_step", ["model_id", "seq_id"]),
                    ("/asample", ["sampling_session_id", "prompt", "seq_id"]),
                    ("/create_model", ["session_id", "base_model", "model_seq_id"]),
                    ("/forward", ["model_id", "seq_id"]),
                ]
            )
        )
        return kind, (endpoint, draw(st.sampled_from(fields))), "|".join(fields)
    if kind == "seq_id":
        return kind, draw(st.one_of(st.integers(max_value=0), WORDS, st.just(1.5))), "seq_id"
    if kind == "huge_seq_id":
        return kind, draw(st.integers(2**31, 2**80)), "seq_id"
    if kind in ("unknown_model", "unknown_sampler", "unknown_request", "unknown_session"):
        return (
            kind,
            draw(st.text(max_size=12)),
            {
                "unknown_model": "model_id",
                "unknown_sampler": "sampling_session_id",
                "unknown_request": "request_id",
                "unknown_session": "session_id",
            }[kind],
        )
    if kind == "lora_config":
        key = draw(st.sampled_from(["rank", "seed", "train_mlp", "alpha"]))
        value = {
            "rank": st.one_of(st.integers(max_value=0), st.integers(1025, 10**9), WORDS),
            "seed": st.one_of(HUGE_INT, WORDS),
            "train_mlp": st.just("maybe"),
            "alpha": st.just(8),
        }[key]
        return kind, {key: draw(value)}, "lora_config"
    if kind == "oversize":
        return kind, draw(st.integers(BYTES + 1, 3 * BYTES)), "request"
    if kind == "sparse_bomb":
        return kind, draw(st.integers(TOKENS + 1, 1 << 28)), "data"
    if kind == "dtype":
        return kind, draw(st.one_of(st.just(0), st.integers(5, 50))), "data"
    if kind == "token_bytes":
        return kind, draw(st.binary(min_size=1, max_size=9).filter(lambda b: len(b) % 4)), "data"
    if kind == "save_path":
        return (
            kind,
            draw(st.text(max_size=8).filter(lambda s: not re.fullmatch(r"[A-Za-z0-9][\w.-]*", s))),
            "path",
        )
    if kind == "load_path":
        return kind, draw(st.text(max_size=12)), "path"
    field = draw(st.sampled_from(["topk_sample_logprobs", "prompt_alt_tokens_k"]))
    value = draw(st.one_of(st.integers(max_value=-1), st.integers(1025, 10**9), WORDS))
    return kind, (field, value), "topk_sample_logprobs|prompt_alt_tokens_k"


def _is_json(raw: bytes) -> bool:
    try:
        json.loads(raw)
    except ValueError:
        return False
    return True


def one_datum(model: str, seq_id: int) -> pb.ForwardBackwardRequest:
    request = pb.ForwardBackwardRequest(model_id=model, seq_id=seq_id, loss_fn="cross_entropy")
    item = request.data.add()
    item.model_input.add().encoded_text.tokens = np.array([5, 6, 7], "<i4").tobytes()
    target = item.loss_fn_inputs["target_tokens"]
    target.dense, target.dtype = np.array([6, 7, 8], "<i8").tobytes(), pb.DTYPE_INT64
    return request


def envelope_request(target: Target, kind: str, arg: Any) -> httpx.Response:  # noqa: C901
    wire, model, seq_id = target.wire, target.model, target.wire.next_seq_id(target.model)
    http, post = wire.http, wire.post
    if kind in ("garbage_proto", "json_as_proto"):
        return http.post("/forward_backward", content=arg, headers=PROTOBUF)
    if kind == "proto_as_json":
        return http.post(
            "/forward_backward", content=arg, headers={"Content-Type": "application/json"}
        )
    if kind == "not_json":
        return http.post("/forward", content=arg, headers={"Content-Type": "application/json"})
    if kind == "form":
        return http.post(arg, data={"model_id": model, "seq_id": str(seq_id)})
    if kind == "deep_json":
        return http.post(
            arg, content="[" * 10_000 + "]" * 10_000, headers={"Content-Type": "application/json"}
        )
    if kind == "not_an_object":
        endpoint, body = arg
        return http.post(
            endpoint, content=json.dumps(body), headers={"Content-Type": "application/json"}
        )
    if kind == "missing":
        endpoint, drop = arg
        body = {
            "/optim_step": {"model_id": model, "seq_id": seq_id, "adam_params": {}},
            "/asample": {
                "sampling_session_id": target.sampler,
                "seq_id": 10**6,
                "prompt": prompt_json([5, 6]),
            },
            "/create_model": {
                "session_id": target.session,
                "model_seq_id": 1_000,
                "base_model": TINY,
            },
            "/forward": {
                "model_id": model,
                "seq_id": seq_id,
                "forward_input": {"data": [datum_json([5, 6, 7])], "loss_fn": "cross_entropy"},
            },
        }[endpoint]
        del body[drop]
        return post(endpoint, **body)
    if kind in ("seq_id", "huge_seq_id"):
        return post("/optim_step", model_id=model, seq_id=arg, adam_params={})
    if kind == "unknown_model":
        return http.post(
            "/forward_backward",
            content=one_datum("m-" + arg, 1).SerializeToString(),
            headers=PROTOBUF,
        )
    if kind == "unknown_sampler":
        return post("/asample", sampling_session_id=arg, seq_id=0, prompt=prompt_json([5]))
    if kind == "unknown_request":
        return post("/retrieve_future", request_id=arg)
    if kind == "unknown_session":
        return post("/create_model", session_id="sess-" + arg, model_seq_id=0, base_model=TINY)
    if kind == "lora_config":
        return post(
            "/create_model",
            session_id=target.session,
            model_seq_id=1_000,
            base_model=TINY,
            lora_config=arg,
        )
    if kind == "oversize":
        return http.post("/forward_backward", content=b"\x00" * arg, headers=PROTOBUF)
    request = one_datum(model, seq_id)
    tensor = request.data[0].loss_fn_inputs["weights"]
    if kind == "sparse_bomb":
        tensor.dtype, tensor.shape[:] = pb.DTYPE_FLOAT32, [1, arg]
        tensor.sparse_csr.crow_indices = np.array([0, 0], "<i8").tobytes()
    elif kind == "dtype":
        tensor.dtype, tensor.dense = arg, b"\x00" * 12
    elif kind == "token_bytes":
        request.data[0].model_input[0].encoded_text.tokens = arg
    elif kind == "save_path":
        return post("/save_weights", model_id=model, seq_id=seq_id, path=arg)
    elif kind == "load_path":
        return post("/load_weights", model_id=model, seq_id=seq_id, path=arg)
    elif kind == "topk":
        return post(
            "/asample",
            sampling_session_id=target.sampler,
            seq_id=next(wire.sample_seq),
            prompt=prompt_json([5]),
            **{arg[0]: arg[1]},
        )
    return http.post("/forward_backward", content=request.SerializeToString(), headers=PROTOBUF)


@FUZZ
@given(case=st.one_of(bad_adams(), bad_samples(), bad_envelopes()))
def test_the_gateway_answers_malformed_requests_with_user_errors(
    target: Target, control: Control, case: Any
) -> None:
    wire = target.wire
    if isinstance(case, BadAdam):
        response = wire.post(
            "/optim_step",
            model_id=target.model,
            seq_id=wire.next_seq_id(target.model),
            adam_params=case.params,
        )
        gateway_error(wire, response, case.field, case)
    elif isinstance(case, BadSample):
        response = wire.http.post(
            "/asample",
            content=json.dumps(
                {
                    "sampling_session_id": target.sampler,
                    "seq_id": next(wire.sample_seq),
                    "prompt": case.prompt,
                    "num_samples": case.num_samples,
                    "sampling_params": case.params,
                }
            ),
            headers={"Content-Type": "application/json"},
        )
        gateway_error(wire, response, case.field, case)
    else:
        kind, arg, field = case
        gateway_error(wire, envelope_request(target, kind, arg), field, case)


# --- afterwards -------------------------------------------------------------------------------
def test_after_the_fuzz_the_worker_serves_and_another_model_is_unchanged(
    service: ServiceClient, deployment: Settings, control: Control, target: Target
) -> None:
    """The same worker process (alive, still registered) serves; the control model's forward
    is bit-for-bit what it was before the fuzz, and a model trained the same way now matches
    it; the fuzz's own gateway model still trains."""
    assert worker(deployment) == control.worker
    os.kill(control.worker[1], 0)
    logprobs, loss = control_logprobs(control.model)
    assert loss == control.loss
    for got, expected in zip(logprobs, control.logprobs, strict=True):
        np.testing.assert_array_equal(got, expected)
    fresh, fresh_loss = control_logprobs(train_control(service))
    assert fresh_loss == control.loss
    for got, expected in zip(fresh, control.logprobs, strict=True):
        np.testing.assert_array_equal(got, expected)
    wire = target.wire
    ok = wire.http.post(
        "/forward_backward",
        content=one_datum(target.model, wire.next_seq_id(target.model)).SerializeToString(),
        headers=PROTOBUF,
    )
    assert ok.status_code == 200, ok.text
    assert "loss_fn_outputs" in wire.result(ok.json()["request_id"])
