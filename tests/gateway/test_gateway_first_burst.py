"""A gateway just started answers a burst of first requests: 16 at once to each
OpenAI-compatible route and to the Tinker sample route, every one 200. The first use of a
tokenizer (and of whatever else a route loads lazily) raced in transformers' lazy imports:
5 of 16 concurrent chat completions answered 500 with "cannot import name 'AutoTokenizer'"."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Iterator

import httpx
import pytest
from procs import SDK_CLIENT_MARKS, gateway_process, make_key, sdk_client
from tinker import types

from queue_tinker.settings import Settings

TINY = "queue-tinker/tiny-llama"
BURST = 16

pytestmark = SDK_CLIENT_MARKS


@pytest.fixture
def fresh_gateway(deployment: Settings) -> Iterator[str]:
    """A gateway process of its own for each test: its first requests are the burst's."""
    log = deployment.data_dir / f"gateway-{uuid.uuid4().hex[:6]}.log"
    with gateway_process(deployment, log) as url:
        yield url


async def burst(url: str, key: str, bodies: list[dict[str, object]]) -> list[httpx.Response]:
    headers = {"X-API-Key": key}
    async with httpx.AsyncClient(timeout=120, headers=headers) as http:
        return list(await asyncio.gather(*(http.post(url, json=body) for body in bodies)))


def completion(n: int) -> dict[str, object]:
    return {"model": TINY, "prompt": f"Q{n}: 2+2?", "max_tokens": 3, "temperature": 0.0}


def chat(n: int) -> dict[str, object]:
    return {
        "model": TINY,
        "messages": [{"role": "user", "content": f"What is {n}+2?"}],
        "max_tokens": 3,
        "temperature": 0.0,
    }


@pytest.mark.parametrize(
    ("route", "body"),
    [("completions", completion), ("chat/completions", chat)],
    ids=["completions", "chat"],
)
def test_a_fresh_gateway_answers_a_burst_of_openai_requests(
    fresh_gateway: str, deployment: Settings, route: str, body: Callable[[int], dict[str, object]]
) -> None:
    """16 concurrent first requests to an OpenAI-compatible route: all 200, each with text."""
    key = make_key(deployment, f"burst-{uuid.uuid4().hex[:6]}")
    url = f"{fresh_gateway}/oai/api/v1/{route}"
    answers = asyncio.run(burst(url, key, [body(n) for n in range(BURST)]))
    assert [a.status_code for a in answers] == [200] * BURST, [
        a.text for a in answers if a.status_code != 200
    ]
    assert all(a.json()["choices"] for a in answers)


def test_a_fresh_gateway_answers_a_burst_of_tinker_samples(
    fresh_gateway: str, deployment: Settings
) -> None:
    """16 sampling clients of the official SDK sample at once from a gateway's first moment:
    every sample comes back (the SDK raises on any answer but 200 it does not retry)."""
    key = make_key(deployment, f"burst-{uuid.uuid4().hex[:6]}")
    with sdk_client(fresh_gateway, key) as service:
        sampler = service.create_sampling_client(base_model=TINY).result()
        params = types.SamplingParams(max_tokens=3, temperature=0.0)
        futures = [
            sampler.sample(types.ModelInput.from_ints([5, 6, n + 7]), 1, params)
            for n in range(BURST)
        ]
        results = [future.result(timeout=120) for future in futures]
    assert all(isinstance(r, types.SampleResponse) for r in results)
    assert all(len(r.sequences[0].tokens) == 3 for r in results)
