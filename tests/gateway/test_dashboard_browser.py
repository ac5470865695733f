"""The dashboard in a real browser while a training loop runs: Debian's headless Chromium,
driven by Playwright, against a real `queue-tinker serve` and a real LoRA worker on the tiny
model. The page must show the run's queue, the worker, a loss curve and the fleet's history
charts with the samples the gateway took; the screenshot is kept as
test-artifacts/dashboard.png. Also: the curve the dashboard serves is exactly the losses the
client got back."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from procs import REPO, gateway_process, lora_deployment, make_key

import queue_tinker
from queue_tinker import types
from queue_tinker.settings import Settings

TINY = "queue-tinker/tiny-llama"
CHROMIUM = "/usr/bin/chromium"
ARTIFACT = REPO / "test-artifacts" / "dashboard.png"
TEXTS = ["the cat sat on the mat", "queue tinker trains loras", "one two three four five"]
AHEAD = 3  # steps kept in flight, so the run's queue is rarely empty when the page looks
MAX_STEPS = 2_000  # a bound, in case a test never stops the loop
HISTORY_INTERVAL_S = 0.5  # the gateway samples the fleet this often (15 s by default)
HISTORY_CHARTS = {  # chart -> the series it draws
    "depth": TINY,
    "oldest_wait_s": TINY,
    "workers": TINY,
    "tokens_per_s": "fleet",
}


def batch() -> list[types.Datum]:
    """Byte tokens (the tiny model's vocabulary), next-token targets."""
    data = []
    for text in TEXTS:
        ids = list(text.encode())
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(ids[:-1]),
                loss_fn_inputs={"target_tokens": np.array(ids[1:])},
            )
        )
    return data


class TrainingLoop:
    """A researcher's loop on a background thread: forward_backward + optim_step, a few steps
    ahead, a checkpoint every 5 steps; the losses the client got back, in order."""

    def __init__(self, service: queue_tinker.ServiceClient) -> None:
        self.training = service.create_lora_training_client(TINY, rank=4)
        self.losses: list[float] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._steps = 0
        self._got_loss = threading.Condition()

    def start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="training-loop", daemon=True)
            self._thread.start()

    def stop(self) -> list[float]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(60)
            assert not self._thread.is_alive(), "the training loop did not stop"
        if self.error is not None:
            raise self.error
        return list(self.losses)

    def wait_for_losses(self, count: int, timeout: float = 60) -> None:
        with self._got_loss:
            assert self._got_loss.wait_for(
                lambda: len(self.losses) >= count or self.error is not None, timeout
            ), f"only {len(self.losses)} losses within {timeout}s"
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        data, adam = batch(), types.AdamParams(learning_rate=1e-2)
        window: list[tuple[Any, Any]] = []
        try:
            while not self._stop.is_set() and self._steps < MAX_STEPS:
                window.append(
                    (
                        self.training.forward_backward(data, "cross_entropy"),
                        self.training.optim_step(adam),
                    )
                )
                self._steps += 1
                if self._steps % 5 == 0:
                    self.training.save_state(f"step-{self._steps}")
                if len(window) > AHEAD:
                    self._collect(*window.pop(0))
            for pending in window:
                self._collect(*pending)
        except BaseException as exc:
            self.error = exc
            with self._got_loss:
                self._got_loss.notify_all()

    def _collect(self, fwd: Any, opt: Any) -> None:
        loss = fwd.result(timeout=60).loss
        opt.result(timeout=60)
        with self._got_loss:
            self.losses.append(loss)
            self._got_loss.notify_all()


@dataclass(frozen=True)
class World:
    settings: Settings
    gateway: str
    key: str  # a key of the "default" tenant, whose run the loop trains
    loop: TrainingLoop


@pytest.fixture(scope="module")
def world(
    redis_url: str, database_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[World]:
    log = tmp_path_factory.mktemp("dashboard-browser") / "gateway.log"
    with (
        lora_deployment(
            redis_url, database_url, TINY, history_interval_s=HISTORY_INTERVAL_S
        ) as settings,
        gateway_process(settings, log) as gateway,
    ):
        service = queue_tinker.ServiceClient(settings)  # the "default" tenant
        loop = TrainingLoop(service)
        try:
            yield World(settings, gateway, make_key(settings, "default"), loop)
        finally:
            try:
                loop.stop()
            finally:
                service.close()


# Whether the page shows, at one moment, the run's queue, a worker and a curve of >= 3 points.
PAGE_READY = """([modelId]) => {
    const queue = document.querySelector(`#queues tr[data-model-id="${modelId}"]`);
    const worker = document.querySelector('#workers tr[data-worker-id]');
    const line = document.querySelector('#loss-svg path.loss-line');
    const points = line ? (line.getAttribute('d').match(/[ML]/g) || []).length : 0;
    return Boolean(queue && worker && points >= 3);
}"""

# Whether every history chart draws at least 3 points of its series.
HISTORY_READY = """([charts]) => Object.entries(charts).every(([chart, series]) => {
    const line = document.querySelector(
        `#history-svg-${chart} path.series[data-series="${series}"]`);
    return Boolean(line) && Number(line.dataset.points) >= 3;
})"""

# Each history chart's line of its series: the points drawn and the newest point's time.
HISTORY_DRAWN = """([charts]) => Object.fromEntries(
    Object.entries(charts).map(([chart, series]) => {
        const line = document.querySelector(
            `#history-svg-${chart} path.series[data-series="${series}"]`);
        const moves = (line.getAttribute('d').match(/[ML]/g) || []).length;
        return [chart, [Number(line.dataset.points), moves, Number(line.dataset.lastT)]];
    }))"""

# Each history chart's lines, by the series they draw.
HISTORY_LINES = """([charts]) => Object.fromEntries(Object.keys(charts).map((chart) => [chart,
    [...document.querySelectorAll(`#history-svg-${chart} path.series`)]
        .map((line) => line.dataset.series)]))"""


def sampled_points(history: dict[str, Any], chart: str, series: str, until: float) -> int:
    """How many known values of `series` the endpoint holds for `chart` up to time `until`."""
    if series == "fleet":
        columns = history["fleet"]
    else:
        (columns,) = [b for b in history["base_models"] if b["base_model"] == series]
    pairs = zip(columns["t"], columns[chart], strict=True)
    return sum(1 for t, v in pairs if t <= until and v is not None)


@pytest.mark.skipif(
    not Path(CHROMIUM).exists(),
    reason=f"{CHROMIUM} is missing (apt-get install chromium; .ci/run does)",
)
def test_the_dashboard_shows_the_queue_the_worker_and_the_loss_curve(world: World) -> None:
    """Headless Chromium signs in with a key and sees, while training runs, the run's queue
    row, the worker (base model, device), a loss curve of several points, and the fleet's
    four history charts drawing exactly the samples the history endpoint holds up to their
    newest point; no script errors. The screenshot goes to test-artifacts/dashboard.png."""
    from playwright.sync_api import sync_playwright

    world.loop.start()
    world.loop.wait_for_losses(3)
    model_id = world.loop.training.model_id
    errors: list[str] = []
    ARTIFACT.parent.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM,
            args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"],
        )
        try:
            page = browser.new_page(viewport={"width": 1500, "height": 1100})
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.on(
                "console",
                lambda msg: (
                    errors.append(f"{msg.text} {msg.location}") if msg.type == "error" else None
                ),
            )
            page.goto(f"{world.gateway}/dashboard")
            page.fill("#key-input", world.key)
            page.click("#key-form button[type=submit]")
            page.wait_for_function(PAGE_READY, arg=[model_id], timeout=30_000)

            worker = page.locator("#workers tr[data-worker-id]").first.inner_text()
            assert TINY in worker and "cpu" in worker
            queue = page.locator(f'#queues tr[data-model-id="{model_id}"]').inner_text()
            assert "default" in queue and "active" in queue
            assert model_id in page.locator("#loss-run").inner_text()
            run = page.locator(f'#runs tr[data-run-id="{model_id}"]')
            assert "selected" in (run.get_attribute("class") or "")
            assert page.locator("#requests tr[data-request-id]").count() > 0
            page.wait_for_selector("#checkpoints tbody tr", timeout=30_000)

            page.wait_for_function(HISTORY_READY, arg=[HISTORY_CHARTS], timeout=30_000)
            drawn = page.evaluate(HISTORY_DRAWN, [HISTORY_CHARTS])
            history = httpx.get(
                f"{world.gateway}/api/v1/dashboard/history",
                headers={"X-API-Key": world.key},
                timeout=10,
            ).json()
            for chart, series in HISTORY_CHARTS.items():
                points, moves, newest = drawn[chart]
                # Samples are appended in time order, so what the page was given is every
                # sample up to its newest point; the endpoint may hold newer ones since.
                assert points == moves == sampled_points(history, chart, series, newest), chart
            # One line per base model with samples; the fleet's tokens/s is one line.
            bases = [b["base_model"] for b in history["base_models"]]
            assert page.evaluate(HISTORY_LINES, [HISTORY_CHARTS]) == {
                chart: ["fleet"] if series == "fleet" else bases
                for chart, series in HISTORY_CHARTS.items()
            }
            assert "queue-tinker/tiny-llama" in page.locator("#history-legend").inner_text()
            page.screenshot(path=str(ARTIFACT), full_page=True)
        finally:
            browser.close()
    assert errors == []
    assert ARTIFACT.stat().st_size > 10_000


def test_the_loss_curve_is_the_losses_the_client_got(world: World) -> None:
    """The dashboard's curve for the run: one point per forward_backward, in order, with the
    very loss the client read from its future, and the optimizer step before it."""
    world.loop.start()
    world.loop.wait_for_losses(5)
    losses = world.loop.stop()
    url = f"{world.gateway}/api/v1/dashboard/runs/{world.loop.training.model_id}/loss"

    def curve() -> list[dict[str, Any]]:
        response = httpx.get(url, headers={"X-API-Key": world.key}, timeout=10)
        assert response.status_code == 200, response.text
        return list(response.json()["points"])

    # The record is written behind the queue (by two recorders, gateway and worker, whose
    # batches may commit out of order): poll until every op is in, then compare.
    deadline = time.monotonic() + 20
    points = curve()
    while [p["step"] for p in points] != list(range(len(losses))):
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
        points = curve()
    assert [p["loss"] for p in points] == losses
    assert [p["step"] for p in points] == list(range(len(losses)))
    assert [p["seq"] for p in points] == sorted(p["seq"] for p in points)
