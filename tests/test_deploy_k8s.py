"""deploy/k8s/ (kustomize) renders, and what it renders is what this service runs.

Every overlay is rendered with `kubectl kustomize`; each object is validated offline against
the Kubernetes 1.32 schemas (kubernetes_validate, strict: no field the API lacks) and each KEDA
ScaledObject against the schema vendored in tests/deploy_schemas/keda/. Then the checks that
tie the manifests to the code: every QT_* variable is a setting of the settings model (and its
value one the model accepts), every queue-tinker command line parses with the real CLI parser,
the image is docker-compose.yml's, probes use real routes and `queue-tinker probe` with a
health file on an emptyDir, the workers' grace period covers the drain the settings allow, the
ScaledObjects' queries name metrics the gateway exports, and GPUs are asked for where they
should be. Each checker returns the problems it found, so the failure tests at the end feed it
a broken copy and see it complain.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import jsonschema  # type: ignore[import-untyped]  # no types-jsonschema in the lock
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

from queue_tinker.cli.main import _parser
from queue_tinker.settings import Settings

REPO = Path(__file__).resolve().parent.parent
K8S = REPO / "deploy" / "k8s"
KEDA_SCHEMA = Path(__file__).parent / "deploy_schemas" / "keda" / "scaledobject.json"
KUBECTL = shutil.which("kubectl")
KUBERNETES = "1.32"
TARGETS = ["base", "overlays/cpu", "overlays/gpu", "overlays/in-cluster", "overlays/redis-sentinel"]
# Workloads of this service (the in-cluster stores are not): app.kubernetes.io/name's value.
APP = "queue-tinker"
# The drain bound's one assumption (deploy/k8s/base/workers/worker.yaml): no setting bounds an
# op's time, so a decode step of the longest sample is taken at this many seconds.
DECODE_STEP_S = 0.05
pytestmark = pytest.mark.skipif(
    KUBECTL is None,
    reason="kubectl is not installed, so deploy/k8s/ cannot be rendered (kustomize is built "
    "into kubectl >= 1.14: install kubectl, e.g. `apt-get install kubectl` from the "
    "Kubernetes apt repository)",
)

Objects = list[dict[str, Any]]


@functools.cache
def _rendered(target: str) -> str:
    assert KUBECTL is not None
    done = subprocess.run(
        [KUBECTL, "kustomize", str(K8S / target)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, f"kubectl kustomize {target} failed:\n{done.stderr}"
    return done.stdout


def render(target: str) -> Objects:
    """The objects `kubectl kustomize` makes of `target`, a fresh copy each call."""
    return [doc for doc in yaml.safe_load_all(_rendered(target)) if doc]


def pod_specs(objects: Objects) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(object, pod spec) of every workload."""
    for obj in objects:
        if obj["kind"] in ("Deployment", "StatefulSet", "Job"):
            yield obj, obj["spec"]["template"]["spec"]


def ours(obj: dict[str, Any]) -> bool:
    return obj["metadata"].get("labels", {}).get("app.kubernetes.io/name") == APP


def component(obj: dict[str, Any]) -> str:
    return str(obj["metadata"]["labels"]["app.kubernetes.io/component"])


def containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return [*pod.get("initContainers", []), *pod["containers"]]


def main_container(pod: dict[str, Any]) -> dict[str, Any]:
    (found,) = [c for c in pod["containers"] if c["name"] == "queue-tinker"]
    return found


def named(objects: Objects, kind: str, name: str) -> dict[str, Any]:
    (found,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def setting_names() -> set[str]:
    """QT_<FIELD> for every field of the settings model (settings.py: env_prefix QT_)."""
    prefix = Settings.model_config.get("env_prefix", "")
    assert prefix == "QT_"
    return {f"{prefix}{name.upper()}" for name in Settings.model_fields}


def env_of(objects: Objects, container: dict[str, Any]) -> dict[str, str]:
    """The variables a container gets: its envFrom ConfigMaps and Secrets, then its env."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env.update(named(objects, "ConfigMap", source["configMapRef"]["name"])["data"])
        if "secretRef" in source:
            secret = named(objects, "Secret", source["secretRef"]["name"])
            env.update(secret.get("stringData", {}))
    env.update({e["name"]: e["value"] for e in container.get("env", []) if "value" in e})
    return env


def settings_of(objects: Objects, container: dict[str, Any]) -> Settings:
    """The settings a container's process reads (the model validates each value)."""
    env = env_of(objects, container)
    given = {k[3:].lower(): v for k, v in env.items() if k.startswith("QT_")}
    # This process's own QT_* variables are no part of the pod's.
    outside = {k: v for k, v in os.environ.items() if not k.upper().startswith("QT_")}
    with mock.patch.dict(os.environ, outside, clear=True):
        return Settings(**given)  # type: ignore[arg-type]


def argv(container: dict[str, Any]) -> list[str]:
    """The container's command line: the image's ENTRYPOINT is `queue-tinker`."""
    return [*container.get("command", ["queue-tinker"]), *container.get("args", [])]


def image_name(image: str) -> str:
    """The image without its tag: queue-tinker:cpu -> queue-tinker (a registry's port kept)."""
    head, slash, tail = image.rpartition("/")
    return head + slash + tail.split(":", 1)[0]


@functools.cache
def compose_image() -> str:
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    return image_name(compose["x-queue-tinker"]["image"])


def flag(args: list[str], name: str, default: str) -> str:
    return args[args.index(name) + 1] if name in args else default


# --- the checkers: each returns the problems it finds ---------------------------------------
@functools.cache
def cli() -> argparse.ArgumentParser:
    return _parser()


@functools.cache
def _keda_validator() -> jsonschema.protocols.Validator:
    schema = json.loads(KEDA_SCHEMA.read_text())
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    validator: jsonschema.protocols.Validator = cls(schema)
    return validator


@functools.cache
def _kubernetes_problem(text: str) -> str | None:
    """One object (as JSON) against the Kubernetes schemas; the same object in several
    overlays is checked once."""
    try:
        kubernetes_validate.validate(json.loads(text), KUBERNETES, strict=True)
    except kubernetes_validate.ValidationError as error:
        return str(error.message)
    return None


def schema_problems(objects: Objects) -> list[str]:
    problems = []
    for obj in objects:
        where = f"{obj['kind']} {obj['metadata'].get('name')}"
        if obj["apiVersion"].startswith("keda.sh/"):
            problems += [f"{where}: {e.message}" for e in _keda_validator().iter_errors(obj)]
            continue
        problem = _kubernetes_problem(json.dumps(obj, sort_keys=True))
        if problem is not None:
            problems.append(f"{where}: {problem}")
    return problems


def setting_problems(objects: Objects) -> list[str]:
    """Every QT_* name given anywhere is a setting; every container's settings validate."""
    known = setting_names()
    given: list[tuple[str, str]] = []
    for obj in objects:
        if obj["kind"] == "ConfigMap":
            given += [(obj["metadata"]["name"], k) for k in obj.get("data", {})]
        if obj["kind"] == "Secret":
            keys = [*obj.get("stringData", {}), *obj.get("data", {})]
            given += [(obj["metadata"]["name"], k) for k in keys]
    for obj, pod in pod_specs(objects):
        for c in containers(pod):
            given += [
                (f"{obj['metadata']['name']}/{c['name']}", e["name"]) for e in c.get("env", [])
            ]
    problems = [
        f"{where}: {key} is no setting"
        for where, key in given
        if key.startswith("QT_") and key not in known
    ]
    for obj, pod in pod_specs(objects):
        for c in containers(pod) if ours(obj) else []:
            try:
                settings_of(objects, c)
            except ValueError as error:
                problems.append(f"{obj['metadata']['name']}/{c['name']}: {error}")
    return problems


def cli_problems(objects: Objects) -> list[str]:
    """Every queue-tinker command line (containers' and exec probes') parses."""
    lines: list[tuple[str, list[str]]] = []
    for obj, pod in pod_specs(objects):
        for c in containers(pod):
            where = f"{obj['metadata']['name']}/{c['name']}"
            if ours(obj):
                lines.append((where, argv(c)))
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                command = c.get(probe, {}).get("exec", {}).get("command")
                if command and command[0] == "queue-tinker":
                    lines.append((f"{where} {probe}", command))
    problems = [] if lines else ["no queue-tinker command line found"]
    for where, line in lines:
        if line[0] != "queue-tinker":
            problems.append(f"{where}: runs {line[0]}, not queue-tinker")
            continue
        try:
            cli().parse_args(line[1:])
        except SystemExit:
            problems.append(f"{where}: queue-tinker does not take {line[1:]}")
    return problems


def image_problems(objects: Objects) -> list[str]:
    """Every container of this service runs docker-compose.yml's image."""
    return [
        f"{obj['metadata']['name']}/{c['name']}: {c['image']} is not {compose_image()}"
        for obj, pod in pod_specs(objects)
        if ours(obj)
        for c in containers(pod)
        if image_name(c["image"]) != compose_image()
    ]


def _mounted_emptydir(pod: dict[str, Any], container: dict[str, Any], path: str) -> bool:
    empty = {v["name"] for v in pod.get("volumes", []) if "emptyDir" in v}
    return any(
        m["name"] in empty and path.startswith(m["mountPath"].rstrip("/") + "/")
        for m in container.get("volumeMounts", [])
    )


def probe_problems(objects: Objects) -> list[str]:
    """The gateway's probes use its real /healthz; workers and the housekeeper are probed by
    `queue-tinker probe` on a health file in an emptyDir; every Deployment waits for the
    schema; a migrate Job applies it."""
    problems = []
    routes = gateway_routes()
    jobs = [o for o in objects if o["kind"] == "Job" and ours(o)]
    if [argv(main_container(j["spec"]["template"]["spec"])) for j in jobs] != [
        ["queue-tinker", "migrate"]
    ]:
        problems.append("no one migrate Job running `queue-tinker migrate`")
    for obj, pod in pod_specs(objects):
        if not ours(obj) or obj["kind"] != "Deployment":
            continue
        name, c = obj["metadata"]["name"], main_container(pod)
        waits = [argv(i)[1:3] for i in pod.get("initContainers", [])]
        if ["migrate", "--wait-s"] not in waits:
            problems.append(f"{name}: no init container waits for the schema")
        probes = [c.get(p) for p in ("startupProbe", "livenessProbe", "readinessProbe")]
        if component(obj) == "gateway":
            paths = {p["httpGet"]["path"] for p in probes if p and "httpGet" in p}
            if not paths or not paths <= routes or "/healthz" not in paths:
                problems.append(f"{name}: probes {sorted(paths)}, not the gateway's /healthz")
            continue
        execs = [p.get("exec", {}).get("command") if p else None for p in probes]
        wanted = 3 if component(obj) == "worker" else 2
        if sum(e == ["queue-tinker", "probe"] for e in execs) < wanted:
            problems.append(f"{name}: not probed by `queue-tinker probe` ({execs})")
        health = settings_of(objects, c).health_file
        if health is None or not _mounted_emptydir(pod, c, str(health)):
            problems.append(f"{name}: QT_HEALTH_FILE={health} is not on a mounted emptyDir")
    return problems


@functools.cache
def gateway_routes() -> frozenset[str]:
    from queue_tinker.gateway.app import create_app

    app = create_app(Settings(redis_url="redis://127.0.0.1:1/0", database_url="postgresql://x@y/z"))
    return frozenset(str(r.path) for r in app.routes if hasattr(r, "path"))


def drain_bound_s(settings: Settings, ranks: int) -> float:
    """What a worker's SIGTERM drain may take, as worker.yaml derives it: the longest sample
    the settings allow (QT_MAX_TOKENS_PER_DATUM decode steps), one lease TTL waiting for a
    Redis that is away, and for a group the launcher's grace for the other ranks."""
    from queue_tinker.workers.group.launcher import STOP_GRACE_S

    group = STOP_GRACE_S if ranks > 1 else 0.0
    return settings.max_tokens_per_datum * DECODE_STEP_S + settings.lease_ttl_ms / 1000 + group


def grace_problems(objects: Objects) -> list[str]:
    problems = []
    for obj, pod in pod_specs(objects):
        if not ours(obj) or obj["kind"] != "Deployment":
            continue
        c, grace = main_container(pod), pod.get("terminationGracePeriodSeconds", 30)
        settings = settings_of(objects, c)
        if component(obj) == "worker":
            bound = drain_bound_s(settings, int(flag(argv(c), "--ranks", "1")))
        elif component(obj) == "gateway":
            bound = settings.long_poll_s
        else:
            continue
        if grace < bound:
            problems.append(f"{obj['metadata']['name']}: grace {grace} s < {bound:g} s")
    return problems


@functools.cache
def exported_metrics() -> frozenset[str]:
    """The families the gateway's /metrics renders (gateway/metrics.py's collector, fed an
    empty overview with one known base model: every family still reports)."""
    from queue_tinker.gateway.metrics import QueueCollector
    from queue_tinker.queue.observe.metrics import MetricsSnapshot

    overview: dict[str, Any] = {"workers": [], "queues": []}
    snapshot = MetricsSnapshot(ops=[], latency=[], tokens={}, tenant_tokens={})
    return frozenset(f.name for f in QueueCollector(overview, {"m"}, snapshot).collect())


def scaling_problems(objects: Objects) -> list[str]:
    """Each ScaledObject scales a worker Deployment on its own base model's qt_demand_models,
    4 models a worker, from 0."""
    problems = []
    for so in (o for o in objects if o["kind"] == "ScaledObject"):
        name, spec = so["metadata"]["name"], so["spec"]
        target = [
            o
            for o in objects
            if o["kind"] == "Deployment" and o["metadata"]["name"] == spec["scaleTargetRef"]["name"]
        ]
        if len(target) != 1:
            problems.append(f"{name}: scales no Deployment")
            continue
        base = flag(argv(main_container(target[0]["spec"]["template"]["spec"])), "--base-model", "")
        if spec.get("minReplicaCount") != 0:
            problems.append(f"{name}: minReplicaCount is not 0")
        for trigger in spec["triggers"]:
            meta = trigger["metadata"]
            metrics = set(re.findall(r"\bqt_[A-Za-z0-9_:]*", meta.get("query", "")))
            if not metrics or not metrics <= exported_metrics():
                problems.append(f"{name}: {sorted(metrics)} not all exported by the gateway")
            if meta.get("query") != f'max(qt_demand_models{{base_model="{base}"}})':
                problems.append(f"{name}: query {meta.get('query')!r} is not {base}'s demand")
            wanted = ("prometheus", "AverageValue", "4", "0")
            found = (
                trigger["type"],
                trigger.get("metricType"),
                meta.get("threshold"),
                meta.get("activationThreshold"),
            )
            if found != wanted:
                problems.append(f"{name}: trigger {found}, not {wanted}")
    return problems


def gpu_problems(objects: Objects, gpus: bool) -> list[str]:
    """With GPUs: a worker asks for 1, a group for one a rank; without: nothing asks for one."""
    problems = []
    for obj, pod in pod_specs(objects):
        for c in containers(pod):
            limit = int(c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0))
            wanted = 0
            if gpus and ours(obj) and component(obj) == "worker" and c["name"] == "queue-tinker":
                wanted = int(flag(argv(c), "--ranks", "1"))
            if limit != wanted:
                problems.append(
                    f"{obj['metadata']['name']}/{c['name']}: {limit} GPUs, not {wanted}"
                )
    return problems


GPU_TARGETS = {"overlays/gpu", "overlays/redis-sentinel"}
CHECKS: dict[str, Callable[[Objects], list[str]]] = {
    "schema": schema_problems,
    "settings": setting_problems,
    "cli": cli_problems,
    "image": image_problems,
    "probes": probe_problems,
    "grace": grace_problems,
    "scaling": scaling_problems,
}


# --- the manifests pass -----------------------------------------------------------------------
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("check", sorted(CHECKS))
def test_every_overlay_passes_every_check(target: str, check: str) -> None:
    assert CHECKS[check](render(target)) == []


@pytest.mark.parametrize("target", TARGETS)
def test_gpus_are_asked_for_in_the_gpu_overlays_alone(target: str) -> None:
    assert gpu_problems(render(target), gpus=target in GPU_TARGETS) == []


def test_the_overlays_are_what_they_say() -> None:
    """The base has the whole service; cpu drops KEDA for the CPU image; in-cluster adds the
    stores and points the settings at them; redis-sentinel names Sentinels with replicas=1."""
    from queue_tinker.queue.connection import target

    base = render("base")
    kinds = {(o["kind"], o["metadata"]["name"]) for o in base}
    assert {
        ("Job", "queue-tinker-migrate"),
        ("Deployment", "gateway"),
        ("Service", "gateway"),
        ("HorizontalPodAutoscaler", "gateway"),
        ("PodDisruptionBudget", "gateway"),
        ("Deployment", "housekeeper"),
        ("ScaledObject", "worker-tiny-llama"),
    } <= kinds
    assert all("namespace" not in o["metadata"] for o in base)
    assert named(base, "Deployment", "housekeeper")["spec"]["replicas"] == 1

    cpu = render("overlays/cpu")
    assert not [o for o in cpu if o["kind"] == "ScaledObject"]
    assert {c["image"] for _, pod in pod_specs(cpu) for c in containers(pod)} == {
        "queue-tinker:cpu"
    }

    stores = render("overlays/in-cluster")
    assert {"redis", "postgres", "minio"} <= {
        o["metadata"]["name"] for o in stores if o["kind"] == "StatefulSet"
    }
    env = env_of(
        stores, main_container(named(stores, "Deployment", "gateway")["spec"]["template"]["spec"])
    )
    assert env["QT_REDIS_URL"] == "redis://redis:6379/0"
    assert "@postgres:5432/" in env["QT_DATABASE_URL"]
    assert env["QT_S3_ENDPOINT_URL"] == "http://minio:9000"

    sentinel = render("overlays/redis-sentinel")
    url = named(sentinel, "Secret", "queue-tinker-secrets")["stringData"]["QT_REDIS_URL"]
    found = target(url)
    assert len(found.sentinels) == 3 and found.service and found.replication.replicas == 1


def test_a_worker_group_is_one_pod_of_its_ranks() -> None:
    """`--ranks N` in one Deployment's pod (the ranks meet on loopback), with N GPUs in the
    gpu overlay, and a grace that covers the launcher's wait for its followers."""
    gpu = render("overlays/gpu")
    groups = [
        (obj, main_container(pod))
        for obj, pod in pod_specs(gpu)
        if ours(obj) and int(flag(argv(main_container(pod)), "--ranks", "1")) > 1
    ]
    assert groups, "no worker group"
    for obj, c in groups:
        ranks = int(flag(argv(c), "--ranks", "1"))
        assert int(c["resources"]["limits"]["nvidia.com/gpu"]) == ranks
        assert obj["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= drain_bound_s(
            settings_of(gpu, c), ranks
        )


@pytest.mark.parametrize(
    ("deployment", "file"),
    [("worker-tiny-llama", "worker.yaml"), ("worker-group-llama-100m", "group.yaml")],
)
def test_the_grace_period_comments_state_the_bound_the_test_derives(
    deployment: str, file: str
) -> None:
    """The derivation in the manifest's comment ends in the number this test computes at the
    base's settings, so the comment cannot drift from the settings."""
    base = render("base")
    worker = main_container(named(base, "Deployment", deployment)["spec"]["template"]["spec"])
    bound = drain_bound_s(settings_of(base, worker), int(flag(argv(worker), "--ranks", "1")))
    assert f"= {bound:g} s" in (K8S / "base" / "workers" / file).read_text()


# --- and each checker catches a broken copy ---------------------------------------------------
def _worker(objects: Objects) -> dict[str, Any]:
    return named(objects, "Deployment", "worker-tiny-llama")["spec"]["template"]["spec"]


def _bogus_setting(objects: Objects) -> None:
    named(objects, "ConfigMap", "queue-tinker-config")["data"]["QT_REDIS_ULR"] = "redis://x"


def _bad_setting_value(objects: Objects) -> None:
    named(objects, "ConfigMap", "queue-tinker-config")["data"]["QT_LEASE_TTL_MS"] = "soon"


def _bogus_env(objects: Objects) -> None:
    main_container(_worker(objects))["env"].append({"name": "QT_HEALTHFILE", "value": "/x"})


def _bad_cli_arg(objects: Objects) -> None:
    main_container(_worker(objects))["args"] += ["--gpus", "2"]


def _bad_probe_command(objects: Objects) -> None:
    main_container(_worker(objects))["livenessProbe"]["exec"]["command"] = ["queue-tinker", "ping"]


def _unknown_field(objects: Objects) -> None:
    main_container(_worker(objects))["restartPolice"] = "Always"


def _wrong_type(objects: Objects) -> None:
    named(objects, "HorizontalPodAutoscaler", "gateway")["spec"]["minReplicas"] = "two"


def _keda_misspelt(objects: Objects) -> None:
    named(objects, "ScaledObject", "worker-tiny-llama")["spec"]["minReplicas"] = 0


def _keda_missing_target(objects: Objects) -> None:
    del named(objects, "ScaledObject", "worker-tiny-llama")["spec"]["scaleTargetRef"]["name"]


def _other_image(objects: Objects) -> None:
    main_container(_worker(objects))["image"] = "ghcr.io/someone/else:1"


def _short_grace(objects: Objects) -> None:
    _worker(objects)["terminationGracePeriodSeconds"] = 30


def _longer_samples(objects: Objects) -> None:
    """A larger QT_MAX_TOKENS_PER_DATUM makes the longest op longer than the grace."""
    named(objects, "ConfigMap", "queue-tinker-config")["data"]["QT_MAX_TOKENS_PER_DATUM"] = "65536"


def _unexported_metric(objects: Objects) -> None:
    trigger = named(objects, "ScaledObject", "worker-tiny-llama")["spec"]["triggers"][0]
    trigger["metadata"]["query"] = 'max(qt_demand_model{base_model="queue-tinker/tiny-llama"})'


def _other_models_demand(objects: Objects) -> None:
    trigger = named(objects, "ScaledObject", "worker-group-llama-100m")["spec"]["triggers"][0]
    trigger["metadata"]["query"] = 'max(qt_demand_models{base_model="queue-tinker/tiny-llama"})'


def _value_metric(objects: Objects) -> None:
    named(objects, "ScaledObject", "worker-tiny-llama")["spec"]["triggers"][0]["metricType"] = (
        "Value"
    )


def _no_schema_wait(objects: Objects) -> None:
    del named(objects, "Deployment", "gateway")["spec"]["template"]["spec"]["initContainers"]


def _health_file_off_volume(objects: Objects) -> None:
    env = main_container(_worker(objects))["env"]
    env[0] = {"name": "QT_HEALTH_FILE", "value": "/tmp/health"}


def _probe_path(objects: Objects) -> None:
    gateway = main_container(named(objects, "Deployment", "gateway")["spec"]["template"]["spec"])
    gateway["readinessProbe"]["httpGet"]["path"] = "/health"


BREAKAGES: list[tuple[Callable[[Objects], None], str]] = [
    (_bogus_setting, "settings"),
    (_bad_setting_value, "settings"),
    (_bogus_env, "settings"),
    (_bad_cli_arg, "cli"),
    (_bad_probe_command, "cli"),
    (_unknown_field, "schema"),
    (_wrong_type, "schema"),
    (_keda_misspelt, "schema"),
    (_keda_missing_target, "schema"),
    (_other_image, "image"),
    (_short_grace, "grace"),
    (_longer_samples, "grace"),
    (_unexported_metric, "scaling"),
    (_other_models_demand, "scaling"),
    (_value_metric, "scaling"),
    (_no_schema_wait, "probes"),
    (_health_file_off_volume, "probes"),
    (_probe_path, "probes"),
]


@pytest.mark.parametrize(("breakage", "check"), BREAKAGES, ids=[b.__name__ for b, _ in BREAKAGES])
def test_each_checker_catches_a_broken_copy(
    breakage: Callable[[Objects], None], check: str
) -> None:
    objects = render("base")
    assert CHECKS[check](objects) == []
    broken = copy.deepcopy(objects)
    breakage(broken)
    assert CHECKS[check](broken) != []


def test_gpu_check_catches_a_worker_without_its_gpu_and_a_cpu_pod_with_one() -> None:
    gpu = render("overlays/gpu")
    del main_container(_worker(gpu))["resources"]["limits"]
    assert gpu_problems(gpu, gpus=True) != []
    cpu = render("overlays/cpu")
    main_container(_worker(cpu))["resources"]["limits"] = {"nvidia.com/gpu": 1}
    assert gpu_problems(cpu, gpus=False) != []
