"""`Base:peft:<tokens>` names: split, written back, refused when the tail is no cap; and the
Python client holding a datum to the cap before it is sent."""

from __future__ import annotations

import numpy as np
import pytest

from queue_tinker.client.training import forward_backward_input
from queue_tinker.errors import UserInputError
from queue_tinker.types.model_names import (
    MAX_CONTEXT_CAP,
    ModelName,
    check_served_name,
    parse_model_name,
    served_base,
)
from queue_tinker.types.tensors import Datum, ModelInput


@pytest.mark.parametrize(
    ("name", "parsed"),
    [
        ("Qwen/Qwen3-8B", ModelName("Qwen/Qwen3-8B")),
        ("Qwen/Qwen3-8B:peft:131072", ModelName("Qwen/Qwen3-8B", 131072)),
        ("/models/llama:peft:1", ModelName("/models/llama", 1)),
        ("a:peft:b:peft:64", ModelName("a:peft:b", 64)),  # the last :peft: is the cap's
    ],
)
def test_a_name_splits_into_base_and_cap_and_writes_back(name: str, parsed: ModelName) -> None:
    assert parse_model_name(name) == parsed
    assert parsed.text == name
    assert served_base(name) == parsed.base


@pytest.mark.parametrize(
    "name", [":peft:128", "m:peft:", "m:peft:x", "m:peft:0", "m:peft:0128", "m:peft:+1"]
)
def test_a_tail_that_is_no_cap_is_refused_naming_the_field(name: str) -> None:
    with pytest.raises(UserInputError, match=r"^model: .* must name a context cap"):
        parse_model_name(name, "model")
    with pytest.raises(UserInputError, match=r"must name a context cap"):
        parse_model_name(f"m:peft:{MAX_CONTEXT_CAP + 1}")


def test_a_worker_takes_its_own_base_with_a_cap_it_can_hold() -> None:
    assert check_served_name("m:peft:512", "m", 1024) == 512
    assert check_served_name("m", "m", 1024) is None
    with pytest.raises(UserInputError, match=r"'m:peft:2048' caps the context at 2048 tokens, "):
        check_served_name("m:peft:2048", "m", 1024)
    with pytest.raises(UserInputError, match=r"not served by this worker \(n\)"):
        check_served_name("m:peft:8", "n", 1024)


def test_the_client_refuses_a_datum_over_the_cap_before_sending_it() -> None:
    def datum(n: int) -> Datum:
        return Datum(
            model_input=ModelInput.from_ints(list(range(n))),
            loss_fn_inputs={"target_tokens": np.arange(n, dtype=np.int64)},
        )

    forward_backward_input([datum(8)], "cross_entropy", None, base_model="m:peft:8")
    forward_backward_input([datum(9)], "cross_entropy", None, base_model="m")
    with pytest.raises(UserInputError, match=r"data\[1\].model_input: 9 tokens .* cap of 8"):
        forward_backward_input([datum(8), datum(9)], "cross_entropy", None, base_model="m:peft:8")
