"""Protobuf bytes <-> our wire types, for the messages the tinker SDK sends and expects as
protobuf (docs/tinker-http-protocol.md, sections 5.3, 6.2 and 9).

One job: decode a `ForwardBackwardRequest` into a `ForwardBackwardInput`, and encode our
`ForwardBackwardOutput` / `SampleResponse` results. Numeric arrays travel as little-endian
bytes; every bad input raises `UserInputError` naming the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from google.protobuf.message import DecodeError

from queue_tinker.errors import UserInputError
from queue_tinker.gateway.proto import tinker_public_pb2 as pb
from queue_tinker.gateway.proto.wire import envelope_of, oversize
from queue_tinker.types.enums import LossFn
from queue_tinker.types.requests.custom_loss import CustomLoss
from queue_tinker.types.requests.loss_inputs import parse_loss_fn
from queue_tinker.types.requests.request_limits import (
    RequestLimits,
    check_datum_count,
    check_tokens,
)
from queue_tinker.types.requests.sampling import SampleResponse
from queue_tinker.types.requests.training import ForwardBackwardInput, ForwardBackwardOutput
from queue_tinker.types.tensors import (
    Datum,
    EncodedTextChunk,
    ImageChunk,
    ImageFormat,
    ModelInput,
    TensorData,
    TensorDtype,
)

PROTOBUF_MEDIA_TYPE = "application/x-protobuf"
# A loss input holds a value per token (1-D), or per token and class (2-D); more is a mistake.
MAX_TENSOR_DIMS = 8

# Wire dtype -> (how its bytes read, our dtype). INT32 and BFLOAT16 widen, as the SDK does.
_READ_DTYPES: dict[int, tuple[np.dtype, TensorDtype]] = {
    pb.DTYPE_FLOAT32: (np.dtype("<f4"), "float32"),
    pb.DTYPE_INT64: (np.dtype("<i8"), "int64"),
    pb.DTYPE_INT32: (np.dtype("<i4"), "int64"),
    pb.DTYPE_BFLOAT16: (np.dtype("<u2"), "float32"),
}
_WRITE_DTYPES: dict[TensorDtype, tuple[np.dtype, pb.DType]] = {
    "float32": (np.dtype("<f4"), pb.DTYPE_FLOAT32),
    "int64": (np.dtype("<i8"), pb.DTYPE_INT64),
}
_IMAGE_FORMATS: dict[str, ImageFormat] = {"png": "png", "jpeg": "jpeg"}
_DTYPE_NAMES = {value: name for name, value in pb.DType.items()}
_STOP_REASONS = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}


# ---- forward_backward request ----


@dataclass(frozen=True)
class ParsedForwardBackward:
    """A decoded request whose batch is converted only on demand: the gateway needs model_id
    and seq_id even when the batch is bad, to consume that seq_id in the model's order."""

    model_id: str
    seq_id: int
    forward_only: bool
    _request: pb.ForwardBackwardRequest | None = field(repr=False, compare=False)
    _refusal: UserInputError | None = field(default=None, repr=False, compare=False)

    @property
    def loss_id(self) -> str | None:
        """With loss_fn "custom": the uploaded loss it names (loss_fn_config_v2's text)."""
        if self._request is None:  # refused from its wire lengths: batch() raises why
            return None
        value = self._request.loss_fn_config_v2.get("loss_id")
        if self._request.loss_fn != LossFn.CUSTOM or value is None:
            return None
        return value.text if value.WhichOneof("value") == "text" else None

    def batch(
        self, limits: RequestLimits | None = None, custom_loss: CustomLoss | None = None
    ) -> ForwardBackwardInput:
        """The request's data, loss function and config as ours; UserInputError if bad. The
        datum count is checked before any datum is converted, and a sparse tensor's dense size
        before it is allocated (a few bytes of CSR can describe gigabytes). A "custom" loss
        is run from `custom_loss`, the upload its loss_id names."""
        if self._refusal is not None or self._request is None:
            raise self._refusal or UserInputError("body: not parsed")
        request, limits = self._request, limits or RequestLimits.defaults()
        loss_fn = parse_loss_fn(request.loss_fn)
        if loss_fn is LossFn.CUSTOM and custom_loss is None:
            raise UserInputError(
                "loss_fn_config.loss_id: loss_fn 'custom' runs a loss "
                "uploaded with create_custom_loss; name it by its loss_id"
            )
        config = _loss_fn_config(request) if loss_fn is not LossFn.CUSTOM else None
        check_datum_count(len(request.data), limits)
        data = [_datum(f"data[{i}]", datum, limits) for i, datum in enumerate(request.data)]
        return ForwardBackwardInput(
            data=data, loss_fn=loss_fn, loss_fn_config=config, custom_loss=custom_loss
        )


def parse_forward_backward(
    raw: bytes, limits: RequestLimits | None = None
) -> ParsedForwardBackward:
    """Decode a (decompressed) /forward_backward body; only the envelope is checked here.

    The body's datum count and each datum's tokens are first read off the wire from field
    lengths alone (wire.py): a body over a limit is refused without being parsed, which for
    57 MiB held the interpreter lock ~70 ms, and copying its tokens out as much again."""
    refusal = oversize(memoryview(raw), limits or RequestLimits.defaults())
    if refusal is not None:
        envelope = envelope_of(memoryview(raw))
        if envelope is not None:
            return ParsedForwardBackward(*envelope, _request=None, _refusal=refusal)
    request = pb.ForwardBackwardRequest()
    try:
        request.ParseFromString(raw)
    except DecodeError as exc:
        raise UserInputError(
            f"body: not a tinker_public.ForwardBackwardRequest protobuf ({exc})"
        ) from None
    return ParsedForwardBackward(
        model_id=request.model_id,
        seq_id=request.seq_id,
        forward_only=request.forward_only,
        _request=request,
    )


def _loss_fn_config(request: pb.ForwardBackwardRequest) -> dict[str, float] | None:
    """v2 when the SDK sent it (it writes both maps; only v2 can hold text), else the legacy
    map. Our losses take numbers only."""
    if request.loss_fn_config_v2:
        config: dict[str, float] = {}
        for key, value in request.loss_fn_config_v2.items():
            if value.WhichOneof("value") != "number":
                raise UserInputError(
                    f"loss_fn_config_v2[{key!r}]: must be a number; text values are not "
                    "supported by this service's loss functions"
                )
            config[key] = value.number
        return config
    return dict(request.loss_fn_config) or None


def _datum(where: str, datum: pb.Datum, limits: RequestLimits) -> Datum:
    # Provenance spans (model_input_spans, loss_fn_input_spans) are accepted and ignored.
    # Sizes come from byte lengths first, so a datum over a limit is refused before its
    # millions of tokens become Python ints (a 57 MiB body took seconds of gateway CPU).
    # (Reading a bytes field copies it, once: upb's ByteSize would encode it just the same.)
    tokens = sum(
        len(chunk.encoded_text.tokens) // 4 + chunk.image.expected_tokens
        for chunk in datum.model_input
    )
    check_tokens(f"{where}.model_input", tokens, limits)
    for key, tensor in datum.loss_fn_inputs.items():
        if tensor.WhichOneof("encoding") == "dense" and tensor.dtype in _READ_DTYPES:
            values = len(tensor.dense) // _READ_DTYPES[tensor.dtype][0].itemsize
            check_tokens(f"{where}.loss_fn_inputs[{key!r}]", values, limits, what="values")
    chunks = [
        _chunk(f"{where}.model_input.chunks[{j}]", chunk)
        for j, chunk in enumerate(datum.model_input)
    ]
    inputs = {
        key: _tensor(f"{where}.loss_fn_inputs[{key!r}]", tensor, limits)
        for key, tensor in datum.loss_fn_inputs.items()
    }
    return Datum(model_input=ModelInput(chunks=chunks), loss_fn_inputs=inputs)


def _chunk(where: str, chunk: pb.Chunk) -> EncodedTextChunk | ImageChunk:
    kind = chunk.WhichOneof("chunk")
    if kind is None:
        raise UserInputError(f"{where}: empty chunk (set encoded_text or image)")
    if kind == "image":
        return _image(f"{where}.image", chunk.image)
    if kind != "encoded_text":
        raise UserInputError(
            f"{where}: {kind} chunks are not supported (send encoded_text or image chunks)"
        )
    tokens = _array(f"{where}.encoded_text.tokens", chunk.encoded_text.tokens, np.dtype("<i4"))
    return EncodedTextChunk(tokens=tokens.tolist())


def _image(where: str, image: pb.ImageChunk) -> ImageChunk:
    """An image chunk; its size and format against its bytes are checked with the batch
    (loss_inputs.check_batch_size), as for a JSON or Python client's."""
    if image.HasField("override_dimensions"):
        raise UserInputError(
            f"{where}.override_dimensions: not supported; the image's own size is used"
        )
    expected = image.expected_tokens if image.HasField("expected_tokens") else None
    if expected is not None and expected < 1:
        raise UserInputError(f"{where}.expected_tokens: must be at least 1, got {expected}")
    fmt = _IMAGE_FORMATS.get(image.format)
    if fmt is None:
        raise UserInputError(f"{where}.format: must be 'png' or 'jpeg', got {image.format!r:.40}")
    return ImageChunk(data=image.data, format=fmt, expected_tokens=expected)


def _array(where: str, raw: bytes, wire: np.dtype) -> np.ndarray:
    """Little-endian bytes as a 1-D array (an owned, writable copy in native byte order)."""
    if len(raw) % wire.itemsize:
        raise UserInputError(
            f"{where}: {len(raw)} bytes is not a whole number of {wire.itemsize}-byte values"
        )
    return np.frombuffer(raw, dtype=wire).astype(wire.newbyteorder("="))


def _tensor(where: str, tensor: pb.Tensor, limits: RequestLimits) -> TensorData:
    """A dense or sparse-CSR request tensor as our dense TensorData (doc section 9.1)."""
    if tensor.dtype not in _READ_DTYPES:
        name = _DTYPE_NAMES.get(tensor.dtype, str(tensor.dtype))
        raise UserInputError(f"{where}: dtype {name} is not supported; use FLOAT32 or INT64")
    wire, dtype = _READ_DTYPES[tensor.dtype]
    shape = list(tensor.shape)
    if len(shape) > MAX_TENSOR_DIMS:  # numpy itself stops at 64, with a ValueError
        raise UserInputError(
            f"{where}: shape has {len(shape)} dimensions; at most {MAX_TENSOR_DIMS}"
        )
    if any(dim < 0 for dim in shape):
        raise UserInputError(f"{where}: shape {shape} has a negative dimension")
    if tensor.WhichOneof("encoding") == "sparse_csr":
        array = _dense_from_csr(where, tensor.sparse_csr, wire, shape, limits)
    else:
        array = _array(f"{where}.dense", tensor.dense, wire)
        if shape and math.prod(shape) != array.size:
            raise UserInputError(
                f"{where}: dense holds {array.size} values but shape {shape} needs "
                f"{math.prod(shape)}"
            )
        array = array.reshape(shape or [array.size])
    if tensor.dtype == pb.DTYPE_BFLOAT16:
        array = (array.astype(np.uint32) << 16).view(np.float32)  # bf16 = a float32's top half
    return TensorData(data=array.astype(dtype, copy=False), dtype=dtype, shape=list(array.shape))


def _dense_from_csr(
    where: str, csr: pb.SparseCsr, wire: np.dtype, shape: list[int], limits: RequestLimits
) -> np.ndarray:
    """Densify a 2-D CSR tensor; absent cells are 0 (the pad value of loss_fn_inputs)."""
    where = f"{where}: sparse_csr"
    if len(shape) != 2:
        raise UserInputError(f"{where} needs a 2-D shape, got {shape}")
    rows, cols = shape
    # A loss input holds a value per token, so its dense size is bounded like a datum's.
    check_tokens(f"{where} shape {shape} is too large", rows * cols, limits, what="values")
    values = _array(f"{where} values", csr.values, wire)
    crow = _array(f"{where} crow_indices", csr.crow_indices, np.dtype("<i8"))
    col = _array(f"{where} col_indices", csr.col_indices, np.dtype("<i8"))
    if len(crow) != rows + 1:
        raise UserInputError(f"{where} crow_indices has {len(crow)} entries, expected {rows + 1}")
    if crow[0] != 0 or crow[-1] != len(col) or bool(np.any(np.diff(crow) < 0)):
        raise UserInputError(
            f"{where} crow_indices must start at 0, never decrease and end at {len(col)}"
        )
    if len(values) != len(col):
        raise UserInputError(
            f"{where} values has {len(values)} entries but col_indices has {len(col)}"
        )
    if len(col) and (col.min() < 0 or col.max() >= cols):
        raise UserInputError(f"{where} col_indices out of range for {cols} columns")
    row = np.repeat(np.arange(rows), np.diff(crow))
    if np.unique(row * cols + col).size != len(col):
        raise UserInputError(f"{where} lists a cell twice")
    dense = np.zeros((rows, cols), dtype=values.dtype)
    dense[row, col] = values
    return dense


# ---- results ----


def encode_forward_backward_output(out: ForwardBackwardOutput) -> bytes:
    """One ArrayRecord for the whole batch: per field, all datums' values back to back with
    int64 byte offsets, which the SDK slices per datum (doc section 9.3)."""
    msg = pb.ForwardBackwardOutput(loss_fn_output_type=out.loss_fn_output_type)
    msg.metrics.update(out.metrics)
    outputs = out.loss_fn_outputs
    record = msg.loss_fn_outputs.add(num_datums=len(outputs))
    names = list(outputs[0]) if outputs else []
    assert all(d.keys() == set(names) for d in outputs), "datums' output fields differ"
    for name in names:
        tensors = [d[name] for d in outputs]
        assert len({t.dtype for t in tensors}) == 1, f"{name}: datums' dtypes differ"
        wire, dtype = _WRITE_DTYPES[tensors[0].dtype]
        # Each datum's array as [leading, *trailing]; a scalar becomes [1].
        arrays = [
            np.ascontiguousarray(t.data, dtype=wire).reshape(-1, *t.data.shape[1:]) for t in tensors
        ]
        trailing = arrays[0].shape[1:]
        assert all(a.shape[1:] == trailing for a in arrays), f"{name}: trailing shapes differ"
        offsets = np.cumsum([0] + [a.nbytes for a in arrays], dtype=np.int64)
        record.fields[name].CopyFrom(
            pb.BatchedTensor(
                data=b"".join(a.tobytes() for a in arrays),
                offsets=offsets.astype("<i8").tobytes(),
                dtype=dtype,
                trailing_shape=list(trailing),
            )
        )
    return msg.SerializeToString()


TOPK_SENTINEL = -99999.0  # tinker.types.topk_logprobs.MASK_LOGPROB: "not computed"


def encode_sample_response(
    response: SampleResponse, *, prompt_logprobs_last_n: int | None = None
) -> bytes:
    """The sampling result as the SDK reads it (doc section 9.2): prompt logprobs are NaN where
    not computed, including before the last N positions when the request asked for only N
    (the SDK raises if any of those is a number)."""
    msg = pb.SampleResponse(prompt_cache_hit_tokens=response.prompt_cache_hit_tokens)
    for seq in response.sequences:
        sequence = msg.sequences.add(
            stop_reason=_STOP_REASONS[seq.stop_reason],
            tokens=np.asarray(seq.tokens, dtype="<i4").tobytes(),
            logprobs=np.asarray(seq.logprobs, dtype="<f4").tobytes(),
        )
        if seq.topk_logprobs is not None:
            per_token: list[list[tuple[int, float]] | None] = list(seq.topk_logprobs)
            sequence.topk_sampled_logprobs.CopyFrom(_topk_message(per_token, None))
    if response.prompt_logprobs is not None:
        values = np.array(
            [math.nan if v is None else v for v in response.prompt_logprobs], dtype="<f4"
        )
        if prompt_logprobs_last_n is not None:
            values[: max(len(values) - prompt_logprobs_last_n, 0)] = math.nan
        msg.prompt_logprobs = values.tobytes()
    if response.topk_prompt_logprobs is not None:
        msg.topk_prompt_logprobs.CopyFrom(
            _topk_message(response.topk_prompt_logprobs, prompt_logprobs_last_n)
        )
    if response.target_prompt_logprobs is not None:
        targets = np.asarray(response.target_prompt_logprobs, dtype="<f4")
        rows = len(response.target_prompt_logprobs)
        targets = targets.reshape(rows, targets.size // rows if rows else 0)
        msg.target_prompt_logprobs.CopyFrom(
            pb.Tensor(dense=targets.tobytes(), dtype=pb.DTYPE_FLOAT32, shape=list(targets.shape))
        )
    if response.prompt_alt_tokens is not None:
        alt = response.prompt_alt_tokens
        tokens = np.asarray(alt.tokens, dtype="<i8")
        tokens = tokens.reshape(
            len(alt.tokens), tokens.size // len(alt.tokens) if alt.tokens else 0
        )
        logprobs = np.asarray(alt.logprobs, dtype="<f4").reshape(tokens.shape)
        msg.prompt_alt_tokens.tokens.CopyFrom(
            pb.Tensor(dense=tokens.tobytes(), dtype=pb.DTYPE_INT64, shape=list(tokens.shape))
        )
        msg.prompt_alt_tokens.logprobs.CopyFrom(
            pb.Tensor(dense=logprobs.tobytes(), dtype=pb.DTYPE_FLOAT32, shape=list(tokens.shape))
        )
    return msg.SerializeToString()


def _topk_message(
    topk: list[list[tuple[int, float]] | None], last_n: int | None
) -> pb.TopkLogprobs:
    """(length, k) matrices; a position not computed (the first; those before the last N when
    only N were asked for) holds the SDK's sentinel: token 0, logprob -99999."""
    k = max((len(row) for row in topk if row), default=0)
    ids = np.zeros((len(topk), k), dtype="<i4")
    values = np.full((len(topk), k), TOPK_SENTINEL, dtype="<f4")
    first = max(len(topk) - last_n, 0) if last_n is not None else 0
    for i, row in enumerate(topk):
        if row and i >= first:
            ids[i, : len(row)] = [token for token, _ in row]
            values[i, : len(row)] = [value for _, value in row]
    return pb.TopkLogprobs(
        token_ids=ids.tobytes(), logprobs=values.tobytes(), k=k, length=len(topk)
    )
