"""Images in model inputs on the LoRA engine: the built-in tiny vision-language model
(queue-tinker/tiny-vl), its training and sampling paths checked against each other, and the
errors of images a model cannot take."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from engine_driver import Driver, run_op, run_stepped
from PIL import Image

from queue_tinker.errors import UserInputError
from queue_tinker.queue.dispatch.dispatcher import Op
from queue_tinker.types import OpKind, codec
from queue_tinker.types.requests.training import AdamParams
from queue_tinker.types.tensors import Datum, EncodedTextChunk, ImageChunk, ModelInput
from queue_tinker.workers.executor.lora import LoraExecutor
from queue_tinker.workers.model.vision_language import joined, rope_positions

VL_BUILTINS = ("queue-tinker/tiny-vl", "queue-tinker/tiny-qwen3-vl")  # Qwen2-VL, Qwen3-VL
TEXT = "queue-tinker/tiny-llama"
IMAGE_TOKENS = 12  # a 24x32 image: 6x8 patches of 4x4 pixels, merged 2x2


def png(color: tuple[int, int, int], size: tuple[int, int] = (32, 24)) -> bytes:
    """A solid-colour PNG with a diagonal stripe (not every patch alike)."""
    pixels = np.zeros((size[1], size[0], 3), dtype=np.uint8)
    pixels[:] = color
    for i in range(min(size)):
        pixels[i, i] = (255 - color[0], 255 - color[1], 255 - color[2])
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


RED, BLUE = png((200, 30, 30)), png((30, 30, 200))


def image_input(
    image: bytes, after: bytes = b"it is", expected: int | None = IMAGE_TOKENS
) -> ModelInput:
    return ModelInput(
        chunks=[
            EncodedTextChunk(tokens=list(b"look: ")),
            ImageChunk(data=image, format="png", expected_tokens=expected),
            EncodedTextChunk(tokens=list(after)),
        ]
    )


def scored_datum(model_input: ModelInput, answer: bytes) -> Datum:
    """The answer's bytes scored after the input (target i is the token after position i)."""
    n = model_input.length
    targets = np.zeros(n, dtype=np.int64)
    weights = np.zeros(n, dtype=np.float32)
    targets[-len(answer) :] = list(answer)
    weights[-len(answer) :] = 1.0
    return Datum(
        model_input=model_input, loss_fn_inputs={"target_tokens": targets, "weights": weights}
    )


@pytest.fixture(scope="module", params=VL_BUILTINS, ids=lambda name: name.split("/")[1])
def vl(request: pytest.FixtureRequest, scratch: Path) -> Driver:
    name = request.param
    storage = scratch / f"{name.split('/')[1]}-storage"
    return Driver(LoraExecutor(name, "cpu", storage, scratch / "models"), scratch, name)


def sample_op(engine: LoraExecutor, seq: int, prompt: ModelInput, **body: Any) -> Op:
    payload = {
        "prompt": prompt.model_dump(),
        "num_samples": 1,
        "sampling_params": {"max_tokens": 4, "temperature": 0.0, "stop": []},
        "prompt_logprobs": True,
        **body,
    }
    return Op(
        job_id=f"s:{seq}", model_id="s", seq=seq, kind=OpKind.SAMPLE, payload=codec.encode(payload)
    )


def test_sampling_an_image_prompt_scores_what_a_forward_pass_scores(vl: Driver) -> None:
    """Greedy sampling from an image prompt: its prompt logprobs and each generated token's
    logprob are what a forward pass over the prompt and the tokens gives (the decode steps'
    positions follow the image's 3-D ones); another image changes them, the same one not."""
    vl.create("fwd")
    create = {"base_model": vl.base, "tenant_id": "default"}
    run_op(vl.engine, Op("s:0", "s", 0, OpKind.CREATE_SAMPLING_SESSION, codec.encode(create)))
    red, blue, again = run_stepped(
        vl.engine,
        [sample_op(vl.engine, i, image_input(img)) for i, img in enumerate((RED, BLUE, RED), 1)],
    )
    assert not isinstance(red, Exception) and not isinstance(blue, Exception)
    assert not isinstance(again, Exception)
    red_out, blue_out = codec.decode(red.result), codec.decode(blue.result)
    assert codec.decode(again.result) == red_out
    prompt = image_input(RED)
    tokens = red_out["sequences"][0]["tokens"]
    assert len(tokens) == 4
    full = prompt.append(EncodedTextChunk(tokens=tokens[:-1]))
    n = prompt.length
    text_after = list(b"it is")
    targets = np.array([0] * (n - len(text_after)) + text_after[1:] + tokens, dtype=np.int64)
    scored = vl.forward("fwd", [Datum(model_input=full, loss_fn_inputs={"target_tokens": targets})])
    logprobs = scored.loss_fn_outputs[0]["logprobs"].data
    # The adapter starts as the base model (LoRA B is zero), so both score the same weights.
    np.testing.assert_allclose(red_out["prompt_logprobs"][-4:], logprobs[n - 5 : n - 1], atol=1e-4)
    np.testing.assert_allclose(red_out["sequences"][0]["logprobs"], logprobs[n - 1 :], atol=1e-4)
    differs = np.abs(np.subtract(red_out["prompt_logprobs"][-4:], blue_out["prompt_logprobs"][-4:]))
    assert differs.max() > 1e-3


def test_image_prompts_never_share_the_prefix_cache(vl: Driver) -> None:
    """Two images expand to the same placeholder ids: a prompt holding one never joins from,
    or seeds, the sampler's prefix cache, so the second image is not answered from the
    first's states (no cache hit, other logprobs)."""
    create = {"base_model": vl.base, "tenant_id": "default"}
    run_op(vl.engine, Op("s:0", "s", 0, OpKind.CREATE_SAMPLING_SESSION, codec.encode(create)))
    long_text = b"it is, as one can see in the picture above, a colour"  # past a cache block
    red, blue = (  # one after the other: the second is admitted once the first is done
        run_stepped(
            vl.engine, [sample_op(vl.engine, i, image_input(img, long_text), prompt_logprobs=False)]
        )[0]
        for i, img in enumerate((RED, BLUE), 1)
    )
    assert not isinstance(red, Exception) and not isinstance(blue, Exception)
    red_out, blue_out = codec.decode(red.result), codec.decode(blue.result)
    assert red_out["prompt_cache_hit_tokens"] == blue_out["prompt_cache_hit_tokens"] == 0
    gap = np.subtract(red_out["sequences"][0]["logprobs"], blue_out["sequences"][0]["logprobs"])
    assert np.abs(gap).max() > 1e-3


def test_training_on_an_image_lowers_the_loss_of_the_text_after_it(vl: Driver) -> None:
    """forward_backward with weights on the text after an image, then optim_step: the loss
    falls; the positions an image takes are expected_tokens, as the loss inputs align them."""
    vl.create("sft", seed=1)
    data = [
        scored_datum(image_input(RED, b" it is red"[:-1]), b" red"),
        scored_datum(image_input(BLUE, b" it is blue"[:-1]), b" blue"),
    ]
    losses = []
    for _ in range(6):
        losses.append(vl.fb("sft", data).loss)
        vl.step("sft", AdamParams(learning_rate=5e-3))
    assert losses[-1] < 0.7 * losses[0], losses


@pytest.mark.parametrize(
    ("chunk", "error"),
    [
        (
            ImageChunk(data=RED, format="png", expected_tokens=5),
            r"data\[0\]\.model_input\.chunks\[1\]\.expected_tokens: 5, but this model's "
            r"processor makes 12 tokens",
        ),
        (
            ImageChunk(data=RED, format="jpeg", expected_tokens=12),
            r"data\[0\]\.model_input\.chunks\[1\]\.format: the data is not a jpeg image",
        ),
        (
            ImageChunk(data=RED[:40], format="png", expected_tokens=12),
            r"data\[0\]\.model_input\.chunks\[1\]\.data: cannot be decoded as a png image",
        ),
        (
            ImageChunk(data=png((0, 0, 0), (1000, 2)), format="png", expected_tokens=12),
            r"data\[0\]\.model_input\.chunks\[1\]\.data: this model's image processor cannot "
            r"take this 1000x2 image \(absolute aspect ratio",
        ),
        (
            ImageChunk(data=RED, format="png"),
            r"data\[0\]\.model_input\.chunks\[1\]\.expected_tokens: required for an image "
            "in a training datum",
        ),
    ],
)
def test_a_bad_image_fails_its_op_naming_the_chunk(
    vl: Driver, chunk: ImageChunk, error: str
) -> None:
    """An image whose bytes, format or expected_tokens are wrong fails its op as the user's
    error, naming the chunk; the model is as it was."""
    vl.create("bad", seed=2)
    model_input = ModelInput(
        chunks=[EncodedTextChunk(tokens=[1, 2]), chunk, EncodedTextChunk(tokens=[3])]
    )
    data = [
        Datum(
            model_input=model_input, loss_fn_inputs={"target_tokens": np.ones(15, dtype=np.int64)}
        )
    ]
    with pytest.raises(UserInputError, match=error):
        vl.fb("bad", data)


def test_a_text_only_model_refuses_an_image_chunk(scratch: Path) -> None:
    """An image chunk sent to a text-only base model fails its op naming the chunk and the
    model; the worker goes on (the next op runs)."""
    driver = Driver(
        LoraExecutor(TEXT, "cpu", scratch / "text-storage", scratch / "models"), scratch
    )
    driver.create("text")
    data = [scored_datum(image_input(RED), b" red")]
    with pytest.raises(
        UserInputError,
        match=r"data\[0\]\.model_input\.chunks\[1\]: queue-tinker/tiny-llama is a text-only model",
    ):
        driver.fb("text", data)
    plain = Datum(
        model_input=ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": np.array([2, 3, 4], dtype=np.int64)},
    )
    assert torch.isfinite(torch.tensor(driver.fb("text", [plain]).loss))


def test_rope_positions_are_the_model_s_own(vl: Driver) -> None:
    """The 3-D rotary positions the worker computes (two images of different grids, one row
    left-padded) are those of the model's get_rope_index."""
    vision = vl.engine.training.rounds.images.vision
    assert vision is not None
    first = vision.expand("x", image_input(RED)).images
    wide = vision.expand("x", image_input(png((1, 2, 3), (48, 16)))).images
    assert first is not None and wide is not None
    rows = [first.ids + wide.ids, [7, 8, *first.ids]]
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    images = joined([first, wide, first], torch.device("cpu"), torch.float32)
    assert images is not None
    grids = images.kwargs["image_grid_thw"]
    model: Any = vl.engine.pool.base.model
    expected, _ = model.get_rope_index(
        ids,
        mm_token_type_ids=(ids == images.token_id).int(),
        image_grid_thw=grids,
        attention_mask=mask,
    )
    assert torch.equal(rope_positions(ids, mask, images)[:, mask.bool()], expected[:, mask.bool()])
