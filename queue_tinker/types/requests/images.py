"""The checks of an image chunk that need no model: its format against its bytes, its size in
bytes and in pixels (QT_MAX_IMAGE_BYTES, QT_MAX_IMAGE_PIXELS).

Client, gateway and worker run them (through the request checks in loss_inputs.py and
sampling.py), so an oversize or mislabelled image is refused before it is queued, and a worker
never hands a decompression bomb to the image decoder. The dimensions are read off the PNG or
JPEG header: no image library on the client.
"""

from __future__ import annotations

import struct

from queue_tinker.errors import UserInputError
from queue_tinker.types.requests.request_limits import RequestLimits, size_text
from queue_tinker.types.tensors import ImageChunk, ModelInput

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
JPEG_START = b"\xff\xd8"
# JPEG start-of-frame markers (baseline, progressive, lossless, ...): they hold the size.
_JPEG_FRAMES = frozenset(
    {*range(0xC0, 0xC4), *range(0xC5, 0xC8), *range(0xC9, 0xCC), 0xCD, 0xCE, 0xCF}
)
# Markers with no length field after them.
_JPEG_STANDALONE = frozenset({0x01, *range(0xD0, 0xDA)})


def check_model_input_images(where: str, model_input: ModelInput, limits: RequestLimits) -> None:
    """Every image chunk of a model input (`where`: its field, e.g. data[0].model_input)."""
    for index, chunk in enumerate(model_input.chunks):
        if isinstance(chunk, ImageChunk):
            check_image(f"{where}.chunks[{index}]", chunk, limits)


def refuse_images(where: str, model_input: ModelInput, base_model: str) -> None:
    """A text-only base model takes no image: refuse the input's first, naming it (the worker
    for any model; the client already for a built-in one it knows is text-only)."""
    for index, chunk in enumerate(model_input.chunks):
        if isinstance(chunk, ImageChunk):
            raise UserInputError(
                f"{where}.chunks[{index}]: {base_model} is a text-only model; image chunks "
                "need a vision-language base model (e.g. queue-tinker/tiny-vl)"
            )


def check_image(where: str, chunk: ImageChunk, limits: RequestLimits) -> tuple[int, int]:
    """An image's (width, height), once its bytes are within QT_MAX_IMAGE_BYTES, its header is
    its format's and its pixels are within QT_MAX_IMAGE_PIXELS."""
    if len(chunk.data) > limits.image_bytes:
        raise UserInputError(
            f"{where}.data: the image is {size_text(len(chunk.data))}, more than "
            f"QT_MAX_IMAGE_BYTES={limits.image_bytes} ({size_text(limits.image_bytes)}) allows"
        )
    size = image_size(chunk.data, chunk.format)
    if size is None:
        raise UserInputError(
            f"{where}.format: the data is not a {chunk.format} image (its header does not "
            f"read as one; format must be 'png' or 'jpeg' and match the bytes)"
        )
    width, height = size
    if width < 1 or height < 1 or width * height > limits.image_pixels:
        raise UserInputError(
            f"{where}.data: the image is {width}x{height} pixels; QT_MAX_IMAGE_PIXELS="
            f"{limits.image_pixels} allows at most that many (width x height), and at least 1x1"
        )
    return size


def image_size(data: bytes, fmt: str) -> tuple[int, int] | None:
    """(width, height) from a PNG's IHDR or a JPEG's start-of-frame; None if the bytes are
    not that format."""
    if fmt == "png":
        if data[:8] != PNG_SIGNATURE or data[12:16] != b"IHDR" or len(data) < 24:
            return None
        width, height = struct.unpack(">II", data[16:24])
        return int(width), int(height)
    if fmt == "jpeg":
        return _jpeg_size(data)
    return None


def _jpeg_size(data: bytes) -> tuple[int, int] | None:
    if data[:2] != JPEG_START:
        return None
    at = 2
    while at + 4 <= len(data):
        if data[at] != 0xFF:
            return None
        marker = data[at + 1]
        if marker == 0xFF:  # fill byte
            at += 1
            continue
        if marker in _JPEG_STANDALONE:
            at += 2
            continue
        (length,) = struct.unpack(">H", data[at + 2 : at + 4])
        if marker in _JPEG_FRAMES:
            if at + 9 > len(data):
                return None
            height, width = struct.unpack(">HH", data[at + 5 : at + 9])
            return int(width), int(height)
        if marker == 0xDA or length < 2:  # scan data before any frame header: not an image
            return None
        at += 2 + length
    return None
