"""Training through the whole service: client -> Redis -> a real LoRA worker process -> back.

One worker serves the module (loading torch costs seconds); each test uses its own models.
"""

from __future__ import annotations

import asyncio
import gc
import time
import warnings
from collections.abc import Iterator

import numpy as np
import pyrage
import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from procs import housekeeper_process
from sqlalchemy import text
from training_runs import ADAM, BATCHES, RANK, SEED, TINY, adapter_weights, train

import queue_tinker as tinker
from queue_tinker import types
from queue_tinker.errors import ErrorCategory, NotFoundError, RequestFailedError, UserInputError
from queue_tinker.settings import Settings
from queue_tinker.store.db import make_engine
from queue_tinker.workers.model.base_model import load_base_model


@pytest.fixture(scope="module")
def service(deployment: Settings) -> Iterator[tinker.ServiceClient]:
    client = tinker.ServiceClient(deployment)
    yield client
    client.close()


def bare_peft_loop(settings: Settings, steps: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The reference: plain PEFT + torch.optim.AdamW in this process, same model and data."""
    base = load_base_model(TINY, "cpu", settings.models_dir)
    torch.manual_seed(SEED)
    model = get_peft_model(
        base,
        LoraConfig(
            r=RANK,
            lora_alpha=32,
            lora_dropout=0.0,
            task_type="CAUSAL_LM",
            target_modules=[
                "q_proj",
                "k_proj",
                "v_proj",
                "o_proj",
                "gate_proj",
                "up_proj",
                "down_proj",
                "lm_head",
            ],
        ),
    )
    model.eval()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        params,
        lr=ADAM.learning_rate,
        betas=(ADAM.beta1, ADAM.beta2),
        eps=ADAM.eps,
        weight_decay=ADAM.weight_decay,
    )
    losses = []
    for step in range(steps):
        batch = BATCHES[step % len(BATCHES)]
        tokens = [d.model_input.to_ints() for d in batch]
        width = max(map(len, tokens))
        ids = torch.tensor([t + [0] * (width - len(t)) for t in tokens])
        mask = torch.tensor([[1] * len(t) + [0] * (width - len(t)) for t in tokens])
        logits = model(input_ids=ids, attention_mask=mask).logits
        loss = torch.zeros(())
        for row, d in enumerate(batch):
            targets = torch.from_numpy(d.loss_fn_inputs["target_tokens"].to_numpy().copy())
            weights = torch.from_numpy(d.loss_fn_inputs["weights"].to_numpy().copy())
            logp = -F.cross_entropy(logits[row, : len(targets)], targets, reduction="none")
            loss = loss - (weights * logp).sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    state = {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" in k}
    return {k.replace(".default", ""): v for k, v in state.items()}, losses


def test_fifty_steps_match_a_bare_peft_adamw_loop(service: tinker.ServiceClient) -> None:
    """50 optimizer steps through the service leave the same adapter weights (rtol 1e-5) and
    losses as plain PEFT + torch.optim.AdamW on the same data and seed."""
    tc = service.create_lora_training_client(TINY, rank=RANK, seed=SEED)
    losses = train(tc, 50)
    served = adapter_weights(service, tc, "after-50")
    reference, ref_losses = bare_peft_loop(service.settings, 50)
    assert set(served) == set(reference)
    for key, value in reference.items():
        torch.testing.assert_close(served[key], value, rtol=1e-5, atol=1e-7, msg=key)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert losses[-1] < losses[0] * 0.5  # and it did learn something


def test_resume_with_optimizer_continues_exactly(
    service: tinker.ServiceClient, deployment: Settings
) -> None:
    """save_state, then load_state_with_optimizer from a new client process-side, continues
    step for step like the run that was never interrupted; load_state resets the moments."""
    straight = service.create_lora_training_client(TINY, rank=RANK, seed=SEED)
    train(straight, 6)
    path = straight.save_state("mid").result(timeout=60).path
    expected = train(straight, 4, start=6)
    expected_weights = adapter_weights(service, straight, "end")

    with tinker.ServiceClient(deployment) as other:  # a new client, as after a restart
        resumed = other.create_lora_training_client(TINY, rank=RANK, seed=99)
        assert resumed.load_state_with_optimizer(path).result(timeout=60).path == path
        assert train(resumed, 4, start=6) == expected
        resumed_weights = adapter_weights(other, resumed, "end")
        for key, value in expected_weights.items():
            torch.testing.assert_close(resumed_weights[key], value, rtol=0, atol=0, msg=key)

        fresh_moments = other.create_lora_training_client(TINY, rank=RANK, seed=99)
        fresh_moments.load_state(path).result(timeout=60)
        assert train(fresh_moments, 1, start=6) == expected[:1]  # same weights, same loss
        after = adapter_weights(other, fresh_moments, "one-step")
        key = next(k for k in after if "lora_B" in k)
        assert not torch.allclose(after[key], expected_weights[key])

        # A run created from the state continues the same way, its config from the checkpoint.
        from_state = other.create_training_client_from_state_with_optimizer(path)
        assert (from_state.base_model, from_state.lora_rank) == (TINY, RANK)
        assert train(from_state, 4, start=6) == expected


def test_another_tenants_checkpoint_cannot_be_loaded(
    service: tinker.ServiceClient, deployment: Settings
) -> None:
    """Neither load_state nor create-from-state reads another tenant's checkpoint; both report
    it like a missing one, at the call (before anything is queued)."""
    owner = service.create_lora_training_client(TINY, rank=RANK, seed=SEED)
    path = owner.save_state("private").result(timeout=60).path
    with tinker.ServiceClient(deployment) as other:
        other._holder.tenant_id = "another-tenant"
        with pytest.raises(UserInputError, match="path: no checkpoint"):
            other.create_training_client_from_state(path)
        theirs = other.create_lora_training_client(TINY, rank=RANK, seed=SEED)
        with pytest.raises(UserInputError, match="path: no checkpoint"):
            theirs.load_state(path)
        with pytest.raises(UserInputError, match=r"path: no checkpoint .*unknown run"):
            theirs.load_state("tinker://never-a-run/weights/x")
        with pytest.raises(UserInputError, match=r"path: .* holds weights only"):
            theirs.load_state_with_optimizer(f"tinker://{theirs.model_id}/sampler_weights/x")
        assert theirs.forward(BATCHES[0], "cross_entropy").result(timeout=60).loss > 0


def test_custom_loss_trains_like_the_builtin_loss(service: tinker.ServiceClient) -> None:
    """forward_backward_custom with -Σ w·logp moves the weights exactly as cross_entropy does,
    and returns the user's loss and metrics."""
    builtin = service.create_lora_training_client(TINY, rank=RANK, seed=SEED)
    custom = service.create_lora_training_client(TINY, rank=RANK, seed=SEED)

    def weighted_nll(data: list[types.Datum], logprobs: list[torch.Tensor]):  # type: ignore[no-untyped-def]
        weights = [torch.from_numpy(d.loss_fn_inputs["weights"].to_numpy().copy()) for d in data]
        loss = -sum(torch.dot(w, lp) for w, lp in zip(weights, logprobs, strict=True))
        return loss, {"datums": float(len(data))}

    for step in range(3):
        batch = BATCHES[step % 2]
        expected = builtin.forward_backward(batch, "cross_entropy").result(timeout=60)
        got = custom.forward_backward_custom(batch, weighted_nll).result(timeout=60)
        assert got.metrics["datums"] == len(batch)
        assert got.loss == pytest.approx(expected.loss, rel=1e-5)
        for a, b in zip(got.loss_fn_outputs, expected.loss_fn_outputs, strict=True):
            np.testing.assert_allclose(
                a["logprobs"].to_numpy(), b["logprobs"].to_numpy(), rtol=1e-5
            )
        builtin.optim_step(ADAM).result(timeout=60)
        custom.optim_step(ADAM).result(timeout=60)
    a, b = adapter_weights(service, builtin, "b"), adapter_weights(service, custom, "c")
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-7, msg=key)


def test_async_api_and_model_info(service: tinker.ServiceClient) -> None:
    """The _async variants queue in call order; get_info, the tokenizer, encode/decode work."""

    async def run() -> tuple[float, float]:
        tc = await service.create_lora_training_client_async(TINY, rank=4, seed=1)
        first = await tc.forward_backward_async(BATCHES[0], "cross_entropy")
        step = await tc.optim_step_async(ADAM)
        second = await tc.forward_async(BATCHES[0], "cross_entropy")
        (await step)
        return (await first).loss, (await second).loss

    before, after = asyncio.run(run())
    assert after < before

    tc = service.create_lora_training_client(TINY, rank=4)
    info = tc.get_info()
    assert (info.model_id, info.lora_rank, info.model_data.model_name) == (tc.model_id, 4, TINY)
    assert tc.decode(tc.encode("héllo ✓")) == "héllo ✓"
    assert tc.get_tokenizer().encode("A", add_special_tokens=False) == [65]


def test_user_metadata_is_kept_with_the_run(service: tinker.ServiceClient) -> None:
    """user_metadata given at creation (or to a run made from a state) comes back from
    get_info; a non-string value is refused before anything is queued."""
    tc = service.create_lora_training_client(TINY, rank=4, user_metadata={"renderer": "x"})
    assert tc.get_info().user_metadata == {"renderer": "x"}
    path = tc.save_state("meta").result(timeout=60).path
    resumed = service.create_training_client_from_state(path, user_metadata={"from": path})
    assert resumed.get_info().user_metadata == {"from": path}
    assert service.create_training_client_from_state(path).get_info().user_metadata is None
    with pytest.raises(UserInputError, match=r"user_metadata\['n'\]: keys and values"):
        service.create_lora_training_client(TINY, rank=4, user_metadata={"n": 1})  # type: ignore[dict-item]


def test_a_base_model_no_worker_serves_is_refused_at_once(service: tinker.ServiceClient) -> None:
    """create_lora_training_client on a base model no worker has served fails in under a
    second, naming the served base models, and queues nothing."""
    started = time.monotonic()
    with pytest.raises(
        UserInputError,
        match=rf"'no-such/model' is not served by this "
        rf"deployment; served base models: {TINY}",
    ):
        service.create_lora_training_client("no-such/model", rank=4)
    assert time.monotonic() - started < 1.0


def test_external_weights_are_the_peft_files_encrypted_to_the_recipients(
    service: tinker.ServiceClient,
) -> None:
    """save_weights_external with an age recipient stores each PEFT file as .age, decrypting to
    the bytes a sampler checkpoint of the same weights holds; such a path cannot be loaded or
    sampled from; a bad recipient is refused at the client."""
    tc = service.create_lora_training_client(TINY, rank=4, seed=3)
    identity = pyrage.x25519.Identity.generate()
    external = tc.save_weights_external(
        "ext", age_encryption_recipients=[str(identity.to_public())]
    ).result(timeout=60)
    sampler = tc.save_weights_for_sampler("same").result(timeout=60)
    assert external.path == f"tinker://{tc.model_id}/external_weights/ext"
    storage = service.settings.storage_dir / tc.model_id
    sealed = {f.name: f.read_bytes() for f in (storage / "external_weights" / "ext").iterdir()}
    assert set(sealed) == {
        "adapter_config.json.age",
        "adapter_model.safetensors.age",
        "qt_meta.json",
    }
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        plain = (storage / "sampler_weights" / "same" / name).read_bytes()
        assert pyrage.decrypt(sealed[f"{name}.age"], [identity]) == plain
    with pytest.raises(UserInputError, match="holds external weights"):
        service.create_training_client_from_state(external.path)
    with pytest.raises(UserInputError, match="holds external weights"):
        service.create_sampling_client(model_path=external.path)
    with pytest.raises(UserInputError, match=r"age_encryption_recipients\[0\]"):
        tc.save_weights_external("bad", age_encryption_recipients=["ssh-rsa nope"])
    assert sampler.path.endswith("/sampler_weights/same")


def test_the_rest_client_answers_like_the_sdks(
    service: tinker.ServiceClient, deployment: Settings
) -> None:
    """service.create_rest_client(): the run (with user_metadata), its checkpoints right after
    the save, weights info, TTL and delete (jobs the deployment's housekeeper runs at once),
    as SDK-shaped objects; capabilities name the served model; another tenant's or a deleted
    checkpoint raises NotFoundError."""
    tc = service.create_lora_training_client(TINY, rank=4, user_metadata={"renderer": "r"})
    path = tc.save_state("rest").result(timeout=60).path
    rest = service.create_rest_client()
    run = rest.get_training_run(tc.model_id).result(timeout=30)
    assert (run.base_model, run.lora_rank, run.user_metadata) == (TINY, 4, {"renderer": "r"})
    assert run.last_checkpoint is not None and run.last_checkpoint.tinker_path == path
    assert rest.get_training_run_by_tinker_path(path).result(30).training_run_id == tc.model_id
    listed = rest.list_checkpoints(tc.model_id).result(timeout=30).checkpoints
    assert [(c.checkpoint_id, c.checkpoint_type) for c in listed] == [("weights/rest", "training")]
    assert rest.get_weights_info_by_tinker_path(path).result(timeout=30).lora_rank == 4
    assert tc.model_id in [
        r.training_run_id for r in rest.list_training_runs(limit=100).result(30).training_runs
    ]
    with housekeeper_process(deployment, deployment.data_dir / "housekeeper.log"):
        rest.set_checkpoint_ttl_from_tinker_path(path, 3600).result(timeout=60)
        expires = rest.list_user_checkpoints().result(timeout=30).checkpoints
        assert any(c.tinker_path == path and c.expires_at is not None for c in expires)
        rest.delete_checkpoint_from_tinker_path(path).result(timeout=60)
    with pytest.raises(NotFoundError):
        rest.get_weights_info_by_tinker_path(path).result(timeout=30)
    with pytest.raises(NotFoundError):
        rest.get_training_run("m-not-there").result(timeout=30)
    caps = service.get_server_capabilities()
    assert caps.supported_models[0].model_name == TINY
    assert rest.get_server_capabilities().result(30).supported_models == caps.supported_models
    rest.close()


def test_checkpoints_are_recorded_in_postgres(
    service: tinker.ServiceClient, deployment: Settings
) -> None:
    """Each save writes a checkpoints row with kind, size, and expires_at from ttl_seconds."""
    tc = service.create_lora_training_client(TINY, rank=4)
    train(tc, 1)  # so there are optimizer moments to save
    state = tc.save_state("keep").result(timeout=60).path
    sampler = tc.save_weights_for_sampler("short", ttl_seconds=3600).result(timeout=60).path

    async def rows() -> dict[str, tuple[str, int, bool]]:
        engine = make_engine(deployment.database_url or "")
        try:
            async with engine.connect() as conn:
                result = await conn.execute(
                    text(
                        "SELECT id, kind, size_bytes, expires_at IS NOT NULL FROM checkpoints "
                        "WHERE model_id = :m"
                    ),
                    {"m": tc.model_id},
                )
                return {r[0]: (r[1], r[2], r[3]) for r in result}
        finally:
            await engine.dispose()

    deadline = time.monotonic() + 10
    while len(found := asyncio.run(rows())) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert found[state][0] == "state" and found[state][2] is False
    assert found[sampler][0] == "sampler" and found[sampler][2] is True
    assert found[state][1] > found[sampler][1] > 0  # the state also holds the optimizer


GOOD = BATCHES[0][0]


def _datum(tokens: list[int], **inputs: object) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs=inputs)


CLIENT_SIDE_ERRORS = [
    (
        "lengths differ",
        [_datum([1, 2, 3], target_tokens=np.array([2, 3, 4]), weights=np.ones(2, np.float32))],
        "cross_entropy",
        None,
        "weights has 2 values but target_tokens has 3",
    ),
    ("unknown loss", [GOOD], "mse", None, "'mse' is not a built-in loss function"),
    (
        "missing input",
        [_datum([1, 2], target_tokens=np.array([2, 3]))],
        "ppo",
        None,
        "missing 'logprobs', required by ppo",
    ),
    (
        "nan advantages",
        [
            _datum(
                [1, 2],
                target_tokens=np.array([2, 3]),
                logprobs=np.zeros(2, np.float32),
                advantages=np.array([0.5, np.nan], np.float32),
            )
        ],
        "importance_sampling",
        None,
        "['advantages']: value at position 1 is nan",
    ),
    ("empty batch", [], "cross_entropy", None, "the batch is empty"),
    (
        "gspo ratio mask marks nothing",
        [
            _datum(
                [1, 2],
                target_tokens=np.array([2, 3]),
                logprobs=np.zeros(2, np.float32),
                sequence_ratio_mask=np.zeros(2, np.float32),
            )
        ],
        "gspo",
        None,
        "['sequence_ratio_mask']: marks no token",
    ),
]


@pytest.mark.parametrize(
    ("case", "data", "loss_fn", "config", "message"),
    CLIENT_SIDE_ERRORS,
    ids=[c[0] for c in CLIENT_SIDE_ERRORS],
)
def test_bad_input_is_refused_at_the_client(
    service: tinker.ServiceClient,
    case: str,
    data: list[types.Datum],
    loss_fn: str,
    config: dict[str, float] | None,
    message: str,
) -> None:
    """What the client can check fails before anything is queued, naming the problem."""
    tc = service.training_client(SHARED_MODEL.get(service))
    with pytest.raises(UserInputError) as raised:
        tc.forward_backward(data, loss_fn, config)
    assert message in str(raised.value)


class _SharedModel:
    """One model for the cheap client-side checks (creating one per case is slower)."""

    model_id: str | None = None

    def get(self, service: tinker.ServiceClient) -> str:
        if self.model_id is None:
            self.model_id = service.create_lora_training_client(TINY, rank=4).model_id
        return self.model_id


SHARED_MODEL = _SharedModel()


WORKER_SIDE_ERRORS = [
    (
        "token outside vocabulary",
        _datum([1, 2, 300], target_tokens=np.array([2, 3, 4])),
        "token id 300 at position 2 is outside the vocabulary (0 to 258)",
    ),
    (
        "target outside vocabulary",
        _datum([1, 2, 3], target_tokens=np.array([2, 3, 259])),
        "token id 259 at position 2 is outside the vocabulary",
    ),
    (
        "longer than context",
        _datum(list(range(1, 258)), target_tokens=np.arange(2, 259)),
        "257 tokens is longer than the model's context of 256",
    ),
]


@pytest.mark.parametrize(
    ("case", "datum", "message"), WORKER_SIDE_ERRORS, ids=[c[0] for c in WORKER_SIDE_ERRORS]
)
def test_bad_input_fails_only_its_request(
    service: tinker.ServiceClient, case: str, datum: types.Datum, message: str
) -> None:
    """What only the model knows is checked on the worker: the request fails with a user
    error, the same model's next op works on unchanged state, and other models carry on."""
    tc = service.create_lora_training_client(TINY, rank=4, seed=5)
    bystander = service.create_lora_training_client(TINY, rank=4, seed=5)
    before = tc.forward(BATCHES[0], "cross_entropy").result(timeout=60).loss
    with pytest.raises(RequestFailedError) as raised:
        tc.forward_backward([GOOD, datum], "cross_entropy").result(timeout=60)
    assert raised.value.category is ErrorCategory.USER
    assert message in raised.value.message
    assert raised.value.message.startswith("data[1]")
    assert tc.forward(BATCHES[0], "cross_entropy").result(timeout=60).loss == before
    tc.optim_step(ADAM).result(timeout=60)  # no gradient was left behind by the failed op
    assert tc.forward(BATCHES[0], "cross_entropy").result(timeout=60).loss == before
    assert bystander.forward_backward(BATCHES[0], "cross_entropy").result(timeout=60).loss > 0


def test_checkpoint_paths_and_names_are_checked(service: tinker.ServiceClient) -> None:
    """Bad names and paths are refused at the client; unknown or incompatible checkpoints and
    duplicate names fail on the worker as user errors."""
    tc = service.create_lora_training_client(TINY, rank=4)
    with pytest.raises(UserInputError, match="not a valid checkpoint name"):
        tc.save_state("../escape")
    with pytest.raises(UserInputError, match="not a checkpoint path"):
        tc.load_state("/etc/passwd")
    tc.save_state("dup").result(timeout=60)
    with pytest.raises(RequestFailedError, match="already a state checkpoint"):
        tc.save_state("dup").result(timeout=60)
    with pytest.raises(RequestFailedError, match="no checkpoint at"):
        tc.load_state(f"tinker://{tc.model_id}/weights/missing").result(timeout=60)
    other_rank = service.create_lora_training_client(TINY, rank=8)
    path = other_rank.save_state("r8").result(timeout=60).path
    with pytest.raises(RequestFailedError, match="has LoRA config"):
        tc.load_state(path).result(timeout=60)


def test_unload_ends_the_model(service: tinker.ServiceClient) -> None:
    """After unload_model, the model's ops fail with a user error; its checkpoints remain."""
    tc = service.create_lora_training_client(TINY, rank=4)
    path = tc.save_state("before-unload").result(timeout=60).path
    assert tc.unload_model().result(timeout=60).model_id == tc.model_id
    with pytest.raises(RequestFailedError, match="was unloaded"):
        tc.forward(BATCHES[0], "cross_entropy").result(timeout=60)
    other = service.create_lora_training_client(TINY, rank=4)
    other.load_state(path).result(timeout=60)


def test_closing_the_service_client_closes_its_rest_clients(deployment: Settings) -> None:
    """A RestClient left open by the user has its Postgres connections closed with the
    ServiceClient that made it: nothing is left for the garbage collector to warn about."""
    service = tinker.ServiceClient(deployment)
    rest = service.create_rest_client()
    assert rest.list_user_checkpoints().result(timeout=30).checkpoints is not None
    service.close()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del rest
        gc.collect()
    assert [str(w.message) for w in caught if w.category is ResourceWarning] == []
