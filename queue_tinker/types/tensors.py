"""Data that goes into a model: TensorData, ModelInput and Datum, shaped as in Tinker.

TensorData keeps a numpy array, not a list of numbers: it crosses Redis as raw bytes (the
msgpack codec's numpy extension) and only becomes a JSON list at the HTTP gateway.
"""

from __future__ import annotations

import base64
import binascii
from typing import TYPE_CHECKING, Annotated, Any, Literal

import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_serializer,
    field_validator,
    model_validator,
)

if TYPE_CHECKING:
    import torch

TensorDtype = Literal["int64", "float32"]
_NUMPY_DTYPES: dict[str, type[np.generic]] = {"int64": np.int64, "float32": np.float32}

# The dtype a plain Python list takes when it arrives under one of these loss_fn_inputs keys.
_KEY_DTYPES: dict[str, TensorDtype] = {
    "target_tokens": "int64",
    "weights": "float32",
    "advantages": "float32",
    "logprobs": "float32",
}


def _dtype_of(array: np.ndarray) -> TensorDtype:
    if array.dtype.kind in "iub":
        return "int64"
    if array.dtype.kind == "f":
        return "float32"
    raise ValueError(f"unsupported array dtype {array.dtype}; use integers or floats")


class TensorData(BaseModel):
    """A dense tensor: `data` (kept as a numpy array), `dtype` and `shape`."""

    model_config = ConfigDict(arbitrary_types_allowed=True, frozen=True, extra="forbid")

    data: np.ndarray
    dtype: TensorDtype
    shape: list[int] | None = None

    @model_validator(mode="before")
    @classmethod
    def _to_array(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            return value
        dtype = value.get("dtype")
        raw = value.get("data")
        if dtype not in _NUMPY_DTYPES:
            return value  # the Literal check reports it
        try:
            array = np.asarray(raw if raw is not None else [], dtype=_NUMPY_DTYPES[dtype])
            shape = value.get("shape")
            if shape is not None and list(array.shape) != list(shape):
                if array.size != int(np.prod(shape)):
                    raise ValueError(f"data has {array.size} values but shape is {shape}")
                array = array.reshape(shape)
        except (TypeError, OverflowError) as exc:  # pydantic reports only ValueErrors as input's
            raise ValueError(f"not a {dtype} array: {exc}") from None
        return {**value, "data": array}

    @field_serializer("data", when_used="json")
    def _data_as_list(self, data: np.ndarray) -> list[Any]:
        return data.ravel().tolist()

    @classmethod
    def from_numpy(cls, array: np.ndarray) -> TensorData:
        array = np.asarray(array)
        return cls(data=array, dtype=_dtype_of(array), shape=list(array.shape))

    @classmethod
    def from_torch(cls, tensor: torch.Tensor) -> TensorData:
        return cls.from_numpy(
            tensor.detach().cpu().float().numpy()
            if tensor.is_floating_point()
            else tensor.detach().cpu().numpy()
        )

    def to_numpy(self) -> np.ndarray:
        return self.data

    def to_torch(self) -> torch.Tensor:
        import torch

        return torch.from_numpy(np.array(self.data, copy=True))

    def tolist(self) -> list[Any]:
        return self.data.tolist()  # type: ignore[no-any-return]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TensorData):
            return NotImplemented
        return (
            self.dtype == other.dtype
            and self.data.shape == other.data.shape
            and bool(np.array_equal(self.data, other.data))
        )

    __hash__ = None  # type: ignore[assignment]


def as_tensor_data(key: str, value: Any) -> TensorData:
    """What users pass as a loss_fn_input (numpy, torch, list, ModelInput) as TensorData."""
    if isinstance(value, TensorData):
        return value
    if isinstance(value, ModelInput):
        return TensorData.from_numpy(np.asarray(value.to_ints(), dtype=np.int64))
    if isinstance(value, dict):
        return TensorData.model_validate(value)
    if type(value).__module__.startswith("torch"):
        return TensorData.from_torch(value)
    if isinstance(value, np.ndarray):
        return TensorData.from_numpy(value)
    if isinstance(value, list | tuple):
        dtype = _KEY_DTYPES.get(key)
        if dtype is None:
            return TensorData.from_numpy(np.asarray(value))
        return TensorData(data=np.asarray(value, dtype=_NUMPY_DTYPES[dtype]), dtype=dtype)
    raise TypeError(f"loss_fn_inputs[{key!r}]: expected an array, got {type(value).__name__}")


class EncodedTextChunk(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    tokens: list[int]
    type: Literal["encoded_text"] = "encoded_text"

    @model_validator(mode="before")
    @classmethod
    def _tokens_as_ints(cls, value: Any) -> Any:
        if isinstance(value, dict) and isinstance(value.get("tokens"), np.ndarray):
            return {**value, "tokens": value["tokens"].tolist()}
        return value

    @property
    def length(self) -> int:
        return len(self.tokens)


ImageFormat = Literal["png", "jpeg"]


class ImageChunk(BaseModel):
    """An image in a model input (Tinker's ImageChunk): its encoded bytes (base64 in JSON) and
    format. It takes `expected_tokens` positions of the sequence: the image placeholder tokens
    the model's processor expands it to. The worker counts them and refuses a differing
    `expected_tokens`; a training datum must say it (its loss_fn_inputs align with them)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    data: bytes
    format: ImageFormat
    expected_tokens: int | None = Field(None, ge=1)
    type: Literal["image"] = "image"

    @field_validator("data", mode="before")
    @classmethod
    def _from_base64(cls, value: Any) -> Any:
        if isinstance(value, str):
            try:
                return base64.b64decode(value, validate=True)
            except (binascii.Error, ValueError):
                raise ValueError("not valid base64") from None
        return value

    @field_serializer("data", when_used="json")
    def _as_base64(self, data: bytes) -> str:
        return base64.b64encode(data).decode("ascii")

    @property
    def length(self) -> int:
        """The positions it takes: expected_tokens; 0 while nobody counted them (a sample's
        prompt may leave them to the worker)."""
        return self.expected_tokens or 0

    def __repr__(self) -> str:  # never megabytes of bytes in a log line or an error
        return (
            f"ImageChunk(format={self.format!r}, {len(self.data)} bytes, "
            f"expected_tokens={self.expected_tokens})"
        )


def _chunk_type(value: Any) -> str:
    kind = value.get("type", "encoded_text") if isinstance(value, dict) else value.type
    return str(kind)


# A chunk without "type" is text, as before images were served.
ModelInputChunk = Annotated[
    Annotated[EncodedTextChunk, Tag("encoded_text")] | Annotated[ImageChunk, Tag("image")],
    Discriminator(
        _chunk_type,
        custom_error_type="chunk_type",
        custom_error_message=(
            "a chunk's type must be 'encoded_text' or 'image' (image_asset_pointer, a path "
            "or URL, is not served: send the image's bytes in an image chunk)"
        ),
    ),
]
CHUNK_TAGS = frozenset({"encoded_text", "image"})  # what validation errors' paths leave out


class ModelInput(BaseModel):
    """A sequence made of chunks: encoded text, and images (for vision-language models)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    chunks: list[ModelInputChunk] = Field(default_factory=list)

    @classmethod
    def from_ints(cls, tokens: Any) -> ModelInput:
        return cls(chunks=[EncodedTextChunk(tokens=[int(t) for t in tokens])])

    @classmethod
    def empty(cls) -> ModelInput:
        return cls(chunks=[])

    def to_ints(self) -> list[int]:
        """The token ids; an input with images has none for them: refused."""
        if self.images:
            raise ValueError(
                "to_ints: this model input holds image chunks, which are not token ids"
            )
        return self.text_ints()

    def text_ints(self) -> list[int]:
        """The text chunks' token ids, back to back (images left out)."""
        return [
            t for chunk in self.chunks if isinstance(chunk, EncodedTextChunk) for t in chunk.tokens
        ]

    @property
    def images(self) -> list[ImageChunk]:
        return [chunk for chunk in self.chunks if isinstance(chunk, ImageChunk)]

    @property
    def length(self) -> int:
        """Positions in the sequence: text tokens, and each image's expected_tokens."""
        return sum(chunk.length for chunk in self.chunks)

    @property
    def counted(self) -> bool:
        """Whether `length` is exact: every image's positions known."""
        return all(chunk.expected_tokens is not None for chunk in self.images)

    def append(self, chunk: EncodedTextChunk | ImageChunk) -> ModelInput:
        return ModelInput(chunks=[*self.chunks, chunk])

    def append_int(self, token: int) -> ModelInput:
        return self.append(EncodedTextChunk(tokens=[int(token)]))


class Datum(BaseModel):
    """One training example: the input tokens and the per-token tensors its loss needs.

    Every loss_fn_inputs tensor is aligned with model_input: position i holds what goes with
    the model's prediction at input position i (the target is token i+1 of the full sequence).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    model_input: ModelInput
    loss_fn_inputs: dict[str, TensorData] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _convert_inputs(cls, value: Any) -> Any:
        if isinstance(value, dict) and isinstance(value.get("loss_fn_inputs"), dict):
            try:
                inputs = {k: as_tensor_data(k, v) for k, v in value["loss_fn_inputs"].items()}
            except (TypeError, OverflowError) as exc:  # as ValueError: pydantic reports it
                raise ValueError(str(exc)) from None
            return {**value, "loss_fn_inputs": inputs}
        return value
