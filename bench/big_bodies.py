"""One tenant sends big bodies, another keeps making small requests: how long do the small ones
take, alone, while two attackers send 57 MiB bodies to a bare sink, and to the gateway? How and
how to read it: the `## Gateway under big bodies` section of docs/benchmarks.md.

    .venv/bin/python -m bench.big_bodies                  # writes its docs/benchmarks.md section
"""

from __future__ import annotations

import multiprocessing
import os
import re
import sys
import time
import uuid
from typing import Any

import httpx
import numpy as np

from bench.harness import cli
from bench.harness.gateway import gateway_proc, make_key
from bench.harness.meters import status_kib
from bench.harness.report import Report, Table, Target, docs_of, emit
from bench.harness.run import service_run
from bench.harness.stats import Latency

SECTION = "## Gateway under big bodies"
COMMAND = ".venv/bin/python -m bench.big_bodies"
BODY_MIB = 57
TARGET_P99_MS = 100.0
PROTO = {"Content-Type": "application/x-protobuf"}
JSON = {"Content-Type": "application/json"}
KNOBS = {
    "--bodies": (10, "big bodies the attackers send between them"),
    "--baseline-s": (5.0, "seconds of the victim's requests alone"),
}


# --- the bodies (built in the attacker processes) ------------------------------------------------
def proto_body(model_id: str, seq_id: int) -> bytes:
    from queue_tinker.gateway.proto import tinker_public_pb2 as pb

    tokens = np.zeros(BODY_MIB * 2**20 // 4 - 64, dtype="<i4").tobytes()
    request = pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn="cross_entropy")
    request.data.add().model_input.add().encoded_text.tokens = tokens
    return request.SerializeToString()


def json_body(sampler_id: str, seq_id: int) -> bytes:
    tokens = ",".join(["7"] * (BODY_MIB * 2**20 // 2 - 64))  # "7," per token: 2 bytes each
    return (
        f'{{"sampling_session_id": "{sampler_id}", "seq_id": {seq_id}, "num_samples": 1, '
        f'"prompt": {{"chunks": [{{"tokens": [{tokens}]}}]}}, '
        f'"sampling_params": {{"max_tokens": 1}}}}'
    ).encode()


def attack(
    url: str, key: str, model_id: str, kinds: list[str], first_seq: int, go: Any, out: Any
) -> None:
    """One attacker: builds its bodies (seconds of CPU, before the clock starts), says so on
    `out`, waits for `go`, sends them one after another; (kind, status, seconds, bytes) each."""
    prepared = [
        ("proto", "/api/v1/forward_backward", proto_body(model_id, first_seq + i), PROTO)
        if kind == "proto"
        else (kind, "/api/v1/asample", json_body(f"{model_id}-sampler", i), JSON)
        for i, kind in enumerate(kinds)
    ]
    out.put("ready")
    go.wait()
    results = []
    with httpx.Client(base_url=url, headers={"X-API-Key": key}, timeout=120) as http:
        for kind, path, body, headers in prepared:
            started = time.perf_counter()
            response = http.post(path, content=body, headers=headers)
            results.append((kind, response.status_code, time.perf_counter() - started, len(body)))
    out.put(results)


# --- the control: the same uploads to a sink that is not the gateway ---------------------------
def sink(port_out: Any) -> None:
    """A bare HTTP endpoint on its own process: reads each request's body and answers 400, so
    the uploads cost the machine what they cost anyway, without the gateway."""
    import socket
    import threading

    server = socket.create_server(("127.0.0.1", 0))
    port_out.put(server.getsockname()[1])

    def serve(conn: socket.socket) -> None:
        with conn:
            data = b""
            while True:
                while b"\r\n\r\n" not in data:
                    more = conn.recv(1 << 16)
                    if not more:
                        return
                    data += more
                head, _, data = data.partition(b"\r\n\r\n")
                length = int(re.findall(rb"(?im)^content-length:\s*(\d+)", head)[0])
                while len(data) < length:
                    more = conn.recv(1 << 20)
                    if not more:
                        return
                    length -= len(more)
                data = data[length:] if len(data) >= length else b""
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 2\r\n\r\n{}")

    while True:
        conn, _ = server.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


# --- the victim ----------------------------------------------------------------------------------
def victim(url: str, key: str, seconds: float, stop: Any, out: Any) -> None:
    """Small requests back to back for `seconds`, or until `stop` is set; latencies on `out`."""
    samples = []
    with httpx.Client(base_url=url, headers={"X-API-Key": key}, timeout=30) as http:
        for _ in range(20):  # warm the connection and the gateway's key cache
            http.get("/api/v1/training_runs")
        out.put("measuring")
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline and not stop.is_set():
            started = time.perf_counter()
            response = http.get("/api/v1/training_runs")
            samples.append(time.perf_counter() - started)
            assert response.status_code == 200, response.text
    out.put(samples)


def gateway_peak_mib(pid: int) -> float:
    peak = status_kib(pid, "VmHWM")
    return float("nan") if peak is None else peak / 1024


def tenant(url: str, key: str, base_model: str = "queue-tinker/tiny-llama", **model: Any) -> str:
    """A session and a training run of the key's tenant (never run: no worker is needed), with
    the `model` fields create_model takes beside the base model; the run's id."""
    with httpx.Client(base_url=url, headers={"X-API-Key": key}, timeout=30) as http:
        session = http.post("/api/v1/create_session", json={}).json()["session_id"]
        body = {"session_id": session, "model_seq_id": 0, "base_model": base_model, **model}
        return str(http.post("/api/v1/create_model", json=body).json()["model_id"])


def measure(
    settings: Any, gateway_pid: int, url: str, bodies: int, baseline_s: float
) -> dict[str, Any]:
    """The victim's latency alone, during the control and during the attack; the bodies'
    answers and the gateway's peak memory before and after."""
    load = os.getloadavg()[0]
    victim_key = make_key(settings, f"victim-{uuid.uuid4().hex[:6]}")
    attacker_key = make_key(settings, f"attacker-{uuid.uuid4().hex[:6]}")
    tenant(url, victim_key)
    model_id = tenant(url, attacker_key)
    kinds = (["proto", "json"] * bodies)[:bodies]
    ctx = multiprocessing.get_context("spawn")
    queue: Any = ctx.Queue()

    def phase(target: str) -> tuple[list[float], list[Any], float]:
        """The victim measuring at `url` while two attackers send `kinds` to `target` (the
        gateway, or the control's sink); (its samples, bodies sent, seconds the sending took)."""
        go, stop = ctx.Event(), ctx.Event()
        attackers = [
            ctx.Process(
                target=attack, args=(target, attacker_key, model_id, half, 1 + 1000 * n, go, queue)
            )
            for n, half in enumerate([kinds[0::2], kinds[1::2]])
        ]  # two senders
        for proc in attackers:
            proc.start()
        for _ in attackers:
            assert queue.get() == "ready"
        watch = ctx.Process(target=victim, args=(url, victim_key, 600.0, stop, queue))
        watch.start()
        assert queue.get() == "measuring"
        time.sleep(0.5)  # a few of the victim's requests before the first body leaves
        started = time.perf_counter()
        go.set()
        sent: list[Any] = []
        for _ in attackers:
            sent += queue.get()
        took = time.perf_counter() - started
        stop.set()
        during = queue.get()
        for proc in (*attackers, watch):
            proc.join()
        return during, sent, took

    stop = ctx.Event()  # never set: the baseline runs its time
    alone = ctx.Process(target=victim, args=(url, victim_key, baseline_s, stop, queue))
    alone.start()
    assert queue.get() == "measuring"
    baseline = queue.get()
    alone.join()
    peak_before = gateway_peak_mib(gateway_pid)
    sink_port: Any = ctx.Queue()
    sink_proc = ctx.Process(target=sink, args=(sink_port,), daemon=True)
    sink_proc.start()
    control, _, _ = phase(f"http://127.0.0.1:{sink_port.get()}")
    sink_proc.terminate()
    during, sent, attack_s = phase(url)
    phases = {"baseline": baseline, "control": control, "attack": during}
    return {
        "sent": sent,
        "attack_s": attack_s,
        "load": load,
        **{name: Latency(samples).summary() for name, samples in phases.items()},
        "peak_before_mib": peak_before,
        "peak_after_mib": gateway_peak_mib(gateway_pid),
    }


def report(result: dict[str, Any], info: dict[str, str]) -> Report:
    """The target, the victim's latency per phase, the bodies' answers and the gateway's peak."""
    sent = result["sent"]
    statuses = sorted({f"{kind} {status}" for kind, status, _, _ in sent})
    sizes = ", ".join(f"{mib:.0f}" for mib in sorted({size / 2**20 for *_, size in sent}))
    p99 = result["attack"]["p99_ms"]
    target = Target(f"the victim's p99 under {TARGET_P99_MS:.0f} ms during the attack",
                    f"{p99:.1f} ms", p99 < TARGET_P99_MS)  # fmt: skip
    phases = {
        "alone": result["baseline"],
        "the same uploads to a sink, not the gateway (control)": result["control"],
        f"during the attack ({result['attack_s']:.1f} s)": result["attack"],
    }
    victim = Table(
        ("victim's requests", "n", "p50 ms", "p99 ms", "max ms"),
        [(name, p["n"], *(f"{p[k]:.1f}" for k in ("p50_ms", "p99_ms", "max_ms")))
         for name, p in phases.items()],
    )  # fmt: skip
    answered = (
        f"Bodies answered: {', '.join(statuses)}. Gateway peak memory (VmHWM): "
        f"{result['peak_before_mib']:.0f} MiB before the attack, "
        f"{result['peak_after_mib']:.0f} MiB after."
    )
    facts = [
        f"Two attacker processes sent {len(sent)} bodies of {sizes} MiB between them. "
        f"Load average {result['load']:.1f} at the start (the victim's own latency alone shows "
        "how busy the machine was)."
    ]
    return Report(SECTION, COMMAND, info, facts, [target], [victim, answered], result)


def main(argv: list[str] | None = None) -> int:
    """Measure the three phases; hand back the report; exit 1 when the target is missed."""
    parser = cli.parser("bench.big_bodies", __doc__, knobs=KNOBS, quick="2 bodies", services=True)
    args = cli.parse(parser, argv, quick={"bodies": 2, "baseline_s": 1.0})
    with (
        service_run(args, (), "qt-bench-big-") as run,
        run.deployment("big") as settings,
        gateway_proc(settings, run.data_dir / "gateway.log") as (proc, url),
    ):
        result = measure(settings, proc.pid, url, args.bodies, args.baseline_s)
    emit(report(result, run.info), docs_of(args), args.json)
    return 0 if result["attack"]["p99_ms"] < TARGET_P99_MS else 1


if __name__ == "__main__":
    sys.exit(main())
