"""`Base:peft:<tokens>` names through the official `tinker` SDK: a real `queue-tinker serve`
and a LoRA worker on queue-tinker/tiny-llama (a context of 256) serve `tiny-llama:peft:32`, list
its longest name, and hold every datum and sample to the cap; caps the model cannot hold, and
names that are not caps, are refused naming what was wrong."""

from __future__ import annotations

import numpy as np
import pytest
import tinker
from procs import SDK_CLIENT_MARKS
from tinker import types

TINY = "queue-tinker/tiny-llama"
CAPPED = f"{TINY}:peft:32"
CONTEXT = 256  # tiny-llama's max_position_embeddings

pytestmark = SDK_CLIENT_MARKS


def datum(length: int) -> types.Datum:
    tokens = [(7 * i) % 250 for i in range(length + 1)]
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": np.array(tokens[1:], dtype=np.int64)},
    )


def test_capabilities_list_the_base_and_its_longest_peft_name(gateway: str, key: str) -> None:
    rest = tinker.RestClient(base_url=gateway, api_key=key)
    try:
        capabilities = rest.get_server_capabilities().result(timeout=30)
    finally:
        rest.holder.close()
    served = [(m.model_name, m.max_context_length) for m in capabilities.supported_models]
    assert served == [(TINY, CONTEXT), (f"{TINY}:peft:{CONTEXT}", CONTEXT)]


def test_a_capped_run_trains_within_the_cap_and_refuses_a_datum_over_it(
    sdk_service: tinker.ServiceClient,
) -> None:
    trainer = sdk_service.create_lora_training_client(base_model=CAPPED, rank=4, seed=3).result()
    assert trainer.get_info().model_data.model_name == CAPPED  # the name as written
    assert trainer.get_tokenizer().encode("ab") == [97, 98]  # the base model's tokenizer
    out = trainer.forward_backward([datum(32)], "cross_entropy").result(timeout=120)
    assert np.isfinite(out.metrics["loss:sum"])
    trainer.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=120)
    with pytest.raises(
        tinker.RequestFailedError,
        match=r"data\[0\]\.model_input: 33 tokens is longer than the context cap of 32",
    ):
        trainer.forward([datum(33)], "cross_entropy").result(timeout=120)
    # The run goes on after the refusal, and its later ops keep the cap.
    assert trainer.forward([datum(8)], "cross_entropy").result(timeout=120).loss_fn_outputs
    sampler = trainer.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(list(range(30)))
    with pytest.raises(
        tinker.BadRequestError, match=r"max_tokens: prompt \(30 tokens\) \+ max_tokens \(8\)"
    ) as refused:
        sampler.sample(prompt, 1, types.SamplingParams(max_tokens=8)).result(timeout=120)
    assert "context cap of 32" in str(refused.value)
    done = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=2, seed=1)).result(120)
    assert len(done.sequences[0].tokens) == 2


def test_a_sampler_on_a_capped_base_name_holds_its_prompts_to_the_cap(
    sdk_service: tinker.ServiceClient,
) -> None:
    sampler = sdk_service.create_sampling_client(base_model=f"{TINY}:peft:16").result()
    with pytest.raises(tinker.BadRequestError, match=r"leaves no room to generate in the context"):
        sampler.sample(
            types.ModelInput.from_ints(list(range(16))), 1, types.SamplingParams(max_tokens=1)
        ).result(timeout=120)
    out = sampler.sample(
        types.ModelInput.from_ints(list(range(10))), 1, types.SamplingParams(max_tokens=6, seed=2)
    ).result(timeout=120)
    assert len(out.sequences[0].tokens) == 6  # unset stops: the cap leaves room for all 6


def test_a_cap_above_the_models_context_is_refused_naming_both(
    sdk_service: tinker.ServiceClient,
) -> None:
    with pytest.raises(
        tinker.RequestFailedError,
        match=rf"caps the context at 4096 tokens, more than {TINY}'s own context of {CONTEXT}",
    ):
        sdk_service.create_lora_training_client(base_model=f"{TINY}:peft:4096", rank=4).result()


@pytest.mark.parametrize("tail", ["abc", "0", "-5", "032", ""])
def test_a_peft_tail_that_is_no_cap_is_refused_at_the_door(
    sdk_service: tinker.ServiceClient, tail: str
) -> None:
    with pytest.raises(tinker.BadRequestError, match=r"base_model: .* must name a context cap"):
        sdk_service.create_lora_training_client(base_model=f"{TINY}:peft:{tail}", rank=4).result()
