"""Images in model inputs through the official `tinker` SDK, unchanged, and the Python client:
a real `queue-tinker serve` and a real LoRA worker on the built-in vision-language model
(queue-tinker/tiny-vl). Supervised training on image + text, sampling from an image prompt,
and the errors of images the service does not take, each naming the chunk."""

from __future__ import annotations

import io
from collections.abc import Iterator

import numpy as np
import pytest
import tinker
from PIL import Image
from procs import SDK_CLIENT_MARKS, lora_deployment
from tinker import types

import queue_tinker
from queue_tinker import types as qt_types
from queue_tinker.client.training import forward_backward_input
from queue_tinker.errors import RequestFailedError, UserInputError
from queue_tinker.settings import Settings

VL = "queue-tinker/tiny-vl"
QWEN3_VL = "queue-tinker/tiny-qwen3-vl"  # Tinker's vision family
IMAGE_TOKENS = 12  # a 24x32 image: 6x8 patches of 4x4 pixels, merged 2x2
MAX_IMAGE_BYTES = 16 * 1024
MAX_IMAGE_PIXELS = 20_000

pytestmark = SDK_CLIENT_MARKS


@pytest.fixture(scope="module")
def deployment(redis_url: str, database_url: str) -> Iterator[Settings]:
    with lora_deployment(
        redis_url,
        database_url,
        VL,
        also=(QWEN3_VL,),
        max_image_bytes=MAX_IMAGE_BYTES,
        max_image_pixels=MAX_IMAGE_PIXELS,
    ) as settings:
        yield settings


def image(color: tuple[int, int, int], size: tuple[int, int] = (32, 24), fmt: str = "PNG") -> bytes:
    """A solid-colour image with a diagonal stripe; noise when `color` is None-like (-1)."""
    pixels = np.zeros((size[1], size[0], 3), dtype=np.uint8)
    if color[0] < 0:
        pixels[:] = np.random.default_rng(0).integers(0, 256, pixels.shape, dtype=np.uint8)
    else:
        pixels[:] = color
        for i in range(min(size)):
            pixels[i, i] = (255 - color[0], 255 - color[1], 255 - color[2])
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=fmt)
    return out.getvalue()


RED, BLUE = image((200, 30, 30)), image((30, 30, 200))


def prompt(data: bytes, text: bytes = b" it is", **image_fields: object) -> types.ModelInput:
    fields = {"format": "png", "expected_tokens": IMAGE_TOKENS, **image_fields}
    return types.ModelInput(
        chunks=[
            types.EncodedTextChunk(tokens=list(b"look: ")),
            types.ImageChunk(data=data, **fields),  # type: ignore[arg-type]
            types.EncodedTextChunk(tokens=list(text)),
        ]
    )


def sft_datum(data: bytes, answer: bytes, **image_fields: object) -> types.Datum:
    """Teacher-forced: the answer follows " it is" after the image; weights on the answer."""
    model_input = prompt(data, b" it is" + answer[:-1], **image_fields)
    n = model_input.length
    targets = np.zeros(n, dtype=np.int64)
    weights = np.zeros(n, dtype=np.float32)
    targets[-len(answer) :] = list(answer)
    weights[-len(answer) :] = 1.0
    return types.Datum(
        model_input=model_input, loss_fn_inputs={"target_tokens": targets, "weights": weights}
    )


@pytest.mark.parametrize("base_model", [VL, QWEN3_VL], ids=["qwen2-vl", "qwen3-vl"])
def test_sdk_trains_on_images_and_samples_from_an_image_prompt(
    sdk_service: tinker.ServiceClient, base_model: str
) -> None:
    """SFT on image + text through the SDK: the loss falls; the sampler's weights sample from
    an image prompt, and the same text with another image gets other prompt logprobs."""
    created = sdk_service.create_lora_training_client(base_model=base_model, rank=4, seed=1)
    trainer = created.result()
    data = [sft_datum(RED, b" red"), sft_datum(BLUE, b" blue")]
    adam = types.AdamParams(learning_rate=5e-3)
    losses = []
    for _ in range(6):
        out = trainer.forward_backward(data, "cross_entropy").result(timeout=120)
        losses.append(out.metrics["loss:sum"])
        trainer.optim_step(adam).result(timeout=120)
    assert losses[-1] < 0.7 * losses[0], losses
    sampler = trainer.save_weights_and_get_sampling_client().result()
    greedy = types.SamplingParams(max_tokens=4, temperature=0.0, stop=[])
    sampled = sampler.sample(prompt(RED), 1, greedy).result(timeout=120)
    assert len(sampled.sequences[0].tokens) == 4
    red = sampler.compute_logprobs(prompt(RED)).result(timeout=120)
    blue = sampler.compute_logprobs(prompt(BLUE)).result(timeout=120)
    assert len(red) == prompt(RED).length
    after = slice(-len(b" it is"), None)  # the text after the image depends on it
    assert np.abs(np.subtract(red[after], blue[after])).max() > 1e-3


# (datum, what the SDK raises, the message): the gateway's 400s, then the worker's user error.
BAD_IMAGES = [
    (
        sft_datum(RED, b" red", format="jpeg"),
        tinker.BadRequestError,
        r"data\[0\]\.model_input\.chunks\[1\]\.format: the data is not a jpeg image",
    ),
    (
        sft_datum(image((-1, 0, 0), (80, 80)), b" red"),
        tinker.BadRequestError,
        r"data\[0\]\.model_input\.chunks\[1\]\.data: the image is .* more than "
        rf"QT_MAX_IMAGE_BYTES={MAX_IMAGE_BYTES}",
    ),
    (
        sft_datum(image((9, 9, 9), (160, 160)), b" red"),
        tinker.BadRequestError,
        r"data\[0\]\.model_input\.chunks\[1\]\.data: the image is 160x160 pixels; "
        rf"QT_MAX_IMAGE_PIXELS={MAX_IMAGE_PIXELS}",
    ),
    (
        sft_datum(RED, b" red", expected_tokens=7),
        tinker.RequestFailedError,
        r"data\[0\]\.model_input\.chunks\[1\]\.expected_tokens: 7, but this model's "
        r"processor makes 12 tokens",
    ),
]


def test_sdk_bad_images_are_refused_naming_the_chunk(sdk_service: tinker.ServiceClient) -> None:
    """A format that is not the bytes', an image over QT_MAX_IMAGE_BYTES or
    QT_MAX_IMAGE_PIXELS (400 from the gateway), an expected_tokens the processor does not
    make (the worker's user error): each raised by the SDK with the chunk's field named."""
    trainer = sdk_service.create_lora_training_client(base_model=VL, rank=2, seed=2).result()
    for datum, raised, error in BAD_IMAGES:
        with pytest.raises(raised, match=error):
            trainer.forward_backward([datum], "cross_entropy").result(timeout=120)


def test_python_client_trains_and_samples_with_images(deployment: Settings) -> None:
    """The Python client: image chunks in a datum and a prompt; a bad format is refused
    before anything is queued, an expected_tokens mismatch by the worker."""
    red = qt_types.ImageChunk(data=RED, format="png", expected_tokens=IMAGE_TOKENS)
    tail = qt_types.EncodedTextChunk(tokens=list(b" it is re"))
    model_input = qt_types.ModelInput(chunks=[red, tail])
    n = model_input.length
    datum = qt_types.Datum(
        model_input=model_input,
        loss_fn_inputs={"target_tokens": np.array([0] * (n - 1) + [100], dtype=np.int64)},
    )
    with queue_tinker.ServiceClient(deployment) as service:
        trainer = service.create_lora_training_client(base_model=VL, rank=2, seed=3)
        out = trainer.forward_backward([datum], "cross_entropy").result(timeout=120)
        assert out.loss_fn_outputs[0]["logprobs"].data.shape == (n,)
        bad = red.model_copy(update={"format": "jpeg"})
        with pytest.raises(UserInputError, match=r"data\[0\]\.model_input\.chunks\[0\]\.format"):
            trainer.forward_backward(
                [datum.model_copy(update={"model_input": qt_types.ModelInput(chunks=[bad, tail])})],
                "cross_entropy",
            )
        sampler = trainer.save_weights_and_get_sampling_client()
        greedy = qt_types.SamplingParams(max_tokens=3, temperature=0.0, stop=[])
        unsized = red.model_copy(update={"expected_tokens": None})  # counted by the worker
        sampled = sampler.sample(qt_types.ModelInput(chunks=[unsized, tail]), 1, greedy)
        assert len(sampled.result(timeout=120).sequences[0].tokens) == 3
        wrong = red.model_copy(update={"expected_tokens": 3})
        with pytest.raises(RequestFailedError, match=r"prompt\.chunks\[0\]\.expected_tokens: 3"):
            sampler.sample(qt_types.ModelInput(chunks=[wrong, tail]), 1, greedy).result(120)


def test_python_client_refuses_images_for_a_built_in_text_only_model() -> None:
    """A built-in text-only base model is known to the client: an image in a datum for it is
    refused before anything is queued, naming the chunk (other models' workers refuse it)."""
    chunk = qt_types.ImageChunk(data=RED, format="png", expected_tokens=IMAGE_TOKENS)
    datum = qt_types.Datum(
        model_input=qt_types.ModelInput(chunks=[qt_types.EncodedTextChunk(tokens=[1]), chunk]),
        loss_fn_inputs={"target_tokens": np.ones(13, dtype=np.int64)},
    )
    with pytest.raises(
        UserInputError,
        match=r"^data\[0\]\.model_input\.chunks\[1\]: queue-tinker/tiny-llama is a text-only",
    ):
        forward_backward_input([datum], "cross_entropy", None, base_model="queue-tinker/tiny-llama")
    assert forward_backward_input([datum], "cross_entropy", None, base_model=VL).data[0] == datum
