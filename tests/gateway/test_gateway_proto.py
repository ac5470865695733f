"""The gateway's protobuf layer against the real `tinker` SDK 0.38: request bytes come from the
SDK's own forward_backward resource, result bytes are read back by the SDK's own decoders
(docs/tinker-http-protocol.md, sections 5.3, 6.2 and 9)."""

from __future__ import annotations

import asyncio
import json
import math
import warnings
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from pydantic.warnings import PydanticDeprecatedSince20
from tinker import types as sdk
from tinker._client import AsyncTinker
from tinker.lib.chunked_fwdbwd_helpers import combine_fwd_bwd_output_results
from tinker.lib.public_interfaces.sampling_client import _check_prompt_logprobs_last_n_honored
from tinker.proto import tinker_public_pb2 as sdk_pb
from tinker.proto.response_conv import deserialize_proto_response

from queue_tinker.errors import UserInputError
from queue_tinker.gateway.proto import tinker_public_pb2 as pb
from queue_tinker.gateway.proto.convert import (
    PROTOBUF_MEDIA_TYPE,
    encode_forward_backward_output,
    encode_sample_response,
    parse_forward_backward,
)
from queue_tinker.types.enums import LossFn
from queue_tinker.types.requests.sampling import SampledSequence, SampleResponse
from queue_tinker.types.requests.training import ForwardBackwardOutput
from queue_tinker.types.tensors import ImageChunk, TensorData

# ---- the SDK as the sender: its real /forward_backward call, answered in-process ----


class _Capture:
    """A minimal ASGI server that records each request and answers like a submit endpoint."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, dict[str, str], bytes]] = []

    async def __call__(
        self,
        scope: MutableMapping[str, Any],
        receive: Callable[[], Awaitable[MutableMapping[str, Any]]],
        send: Callable[[MutableMapping[str, Any]], Awaitable[None]],
    ) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        self.requests.append((scope["path"], headers, body))
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send(
            {"type": "http.response.body", "body": json.dumps({"request_id": "req-1"}).encode()}
        )


def sdk_body(
    data: list[sdk.Datum],
    loss_fn: str = "cross_entropy",
    loss_fn_config: dict[str, float | str] | None = None,
    *,
    forward_only: bool = False,
    model_id: str = "s:train:0",
    seq_id: int = 1,
) -> bytes:
    """The exact bytes `TrainingClient.forward_backward` / `.forward` POSTs for one chunk:
    the SDK's AsyncTrainingResource.forward_backward, over HTTP to an in-process server."""
    capture = _Capture()
    request = sdk.ForwardBackwardRequest(
        forward_backward_input=sdk.ForwardBackwardInput(
            data=data, loss_fn=loss_fn, loss_fn_config=loss_fn_config
        ),  # type: ignore[arg-type]
        model_id=model_id,
        seq_id=seq_id,
    )

    async def post() -> None:
        transport = httpx.ASGITransport(app=capture)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
            client = AsyncTinker(
                api_key="tml-test", base_url="http://gw", http_client=http, max_retries=0
            )
            await client.training.forward_backward(request=request, forward_only=forward_only)

    with warnings.catch_warnings():
        # The SDK builds its submit answer with pydantic's deprecated `construct`.
        warnings.simplefilter("ignore", PydanticDeprecatedSince20)
        asyncio.run(post())
    [(path, headers, body)] = capture.requests
    assert path == "/api/v1/forward_backward"
    assert headers["content-type"] == PROTOBUF_MEDIA_TYPE
    return body


def text_datum(tokens: Iterable[int] | sdk.ModelInput, **inputs: Any) -> sdk.Datum:
    """An SDK datum; the SDK turns lists, numpy and torch inputs into its TensorData."""
    model_input = (
        tokens if isinstance(tokens, sdk.ModelInput) else sdk.ModelInput.from_ints(list(tokens))
    )
    return sdk.Datum(model_input=model_input, loss_fn_inputs=inputs)


def assert_tensor(ours: TensorData, expected: Any, dtype: str) -> None:
    expected = np.asarray(expected)
    assert ours.dtype == dtype
    assert ours.data.dtype == np.dtype(dtype)
    assert ours.data.shape == expected.shape
    np.testing.assert_array_equal(ours.data, expected)


# ---- requests ----


def test_cross_entropy_request_from_the_sdk() -> None:
    weights = np.array([0.0, 1.0, 1.0, 0.5], dtype=np.float32)
    data = [
        text_datum(
            sdk.ModelInput(
                chunks=[
                    sdk.EncodedTextChunk(tokens=[5, 6]),
                    sdk.EncodedTextChunk(tokens=[7, 151_000]),
                ]
            ),
            target_tokens=[6, 7, 151_000, 2],
            weights=weights,
        ),
        text_datum([1, 2, 3], target_tokens=[2, 3, 4], weights=[1.0, 1.0, 1.0]),
    ]
    parsed = parse_forward_backward(sdk_body(data, model_id="sess:train:3", seq_id=7))
    assert (parsed.model_id, parsed.seq_id, parsed.forward_only) == ("sess:train:3", 7, False)

    batch = parsed.batch()
    assert batch.loss_fn is LossFn.CROSS_ENTROPY
    assert batch.loss_fn_config is None
    assert [c.tokens for c in batch.data[0].model_input.chunks] == [[5, 6], [7, 151_000]]
    assert batch.data[1].model_input.to_ints() == [1, 2, 3]
    first = batch.data[0].loss_fn_inputs
    assert first.keys() == {"target_tokens", "weights"}
    assert_tensor(first["target_tokens"], [6, 7, 151_000, 2], "int64")
    assert_tensor(first["weights"], weights, "float32")
    assert_tensor(batch.data[1].loss_fn_inputs["weights"], [1.0, 1.0, 1.0], "float32")


def test_importance_sampling_request_with_torch_tensors_and_a_config() -> None:
    logprobs = torch.tensor([-0.5, -1.25, -3.0])
    advantages = torch.tensor([0.25, 0.25, -1.0])
    data = [
        text_datum(
            [9, 8, 7],
            target_tokens=torch.tensor([8, 7, 6]),
            logprobs=logprobs,
            advantages=advantages,
        )
    ]
    batch = parse_forward_backward(
        sdk_body(data, "importance_sampling", {"clip_low": 0.8, "clip_high": 1.2})
    ).batch()
    assert batch.loss_fn is LossFn.IMPORTANCE_SAMPLING
    assert batch.loss_fn_config == {"clip_low": 0.8, "clip_high": 1.2}
    inputs = batch.data[0].loss_fn_inputs
    assert_tensor(inputs["target_tokens"], [8, 7, 6], "int64")
    assert_tensor(inputs["logprobs"], logprobs.numpy(), "float32")
    assert_tensor(inputs["advantages"], advantages.numpy(), "float32")


def test_2d_torch_inputs_arrive_as_sparse_csr_and_are_densified() -> None:
    weights = torch.zeros(4, 6)
    weights[0, 2], weights[3, 5], weights[3, 0] = 1.0, 0.5, 2.0
    targets = torch.zeros(4, 6, dtype=torch.int64)
    targets[1, 1], targets[2, 4] = 17, 151_000
    body = sdk_body([text_datum([1, 2, 3, 4], target_tokens=targets, weights=weights)])

    sent = sdk_pb.ForwardBackwardRequest.FromString(body).data[0].loss_fn_inputs
    assert sent["weights"].WhichOneof("encoding") == "sparse_csr"  # what the SDK really sends
    assert sent["target_tokens"].WhichOneof("encoding") == "sparse_csr"

    inputs = parse_forward_backward(body).batch().data[0].loss_fn_inputs
    assert_tensor(inputs["weights"], weights.numpy(), "float32")
    assert_tensor(inputs["target_tokens"], targets.numpy(), "int64")


def test_forward_only_and_the_legacy_config_map() -> None:
    body = sdk_body(
        [text_datum([1, 2], target_tokens=[2, 3])],
        "ppo",
        {"clip": 0.2},
        forward_only=True,
        seq_id=12,
    )
    parsed = parse_forward_backward(body)
    assert (parsed.seq_id, parsed.forward_only) == (12, True)
    assert parsed.batch().loss_fn_config == {"clip": 0.2}

    # A sender that fills only the legacy map (the SDK writes both).
    request = pb.ForwardBackwardRequest.FromString(body)
    request.ClearField("loss_fn_config_v2")
    request.loss_fn_config["beta"] = 0.5
    assert parse_forward_backward(request.SerializeToString()).batch().loss_fn_config == {
        "clip": 0.2,
        "beta": 0.5,
    }


def test_provenance_spans_are_accepted_and_ignored() -> None:
    datum = text_datum([1, 2, 3], target_tokens=[2, 3, 4]).with_provenance(
        model_input=[sdk.PromptProvenanceSpan(sequence_id="seq-a", length=3)],
        loss_fn_inputs=[sdk.SampledProvenanceSpan(sequence_id="seq-b", offset=1, length=3)],
    )
    body = sdk_body([datum])
    assert len(sdk_pb.ForwardBackwardRequest.FromString(body).data[0].model_input_spans) == 1
    [ours] = parse_forward_backward(body).batch().data
    assert ours.model_input.to_ints() == [1, 2, 3]
    assert_tensor(ours.loss_fn_inputs["target_tokens"], [2, 3, 4], "int64")


def test_int32_and_bfloat16_tensors_are_widened() -> None:
    request = pb.ForwardBackwardRequest(model_id="m", seq_id=1, loss_fn="cross_entropy")
    datum = request.data.add()
    datum.model_input.add().encoded_text.tokens = np.array([1, 2], "<i4").tobytes()
    datum.loss_fn_inputs["target_tokens"].CopyFrom(
        pb.Tensor(dense=np.array([2, 3], "<i4").tobytes(), dtype=pb.DTYPE_INT32)
    )
    bf16 = (np.array([1.5, -2.0], np.float32).view(np.uint32) >> 16).astype("<u2")
    datum.loss_fn_inputs["weights"].CopyFrom(
        pb.Tensor(dense=bf16.tobytes(), dtype=pb.DTYPE_BFLOAT16, shape=[2])
    )
    inputs = parse_forward_backward(request.SerializeToString()).batch().data[0].loss_fn_inputs
    assert_tensor(inputs["target_tokens"], [2, 3], "int64")
    assert_tensor(inputs["weights"], [1.5, -2.0], "float32")


# ---- bad requests ----


def good_request() -> pb.ForwardBackwardRequest:
    """A valid request (from the SDK) to break one field of at a time."""
    return pb.ForwardBackwardRequest.FromString(
        sdk_body(
            [
                text_datum([1, 2, 3], target_tokens=[2, 3, 4], weights=[1.0, 1.0, 1.0]),
                text_datum(
                    [4, 5],
                    target_tokens=[5, 6],
                    weights=torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]),
                ),
            ]
        )
    )


def batch_error(request: pb.ForwardBackwardRequest) -> str:
    parsed = parse_forward_backward(request.SerializeToString())
    assert (parsed.model_id, parsed.seq_id) == ("s:train:0", 1)  # known even when the batch is bad
    with pytest.raises(UserInputError) as excinfo:
        parsed.batch()
    return excinfo.value.message


def test_the_good_request_is_good() -> None:
    batch = parse_forward_backward(good_request().SerializeToString()).batch()
    assert good_request().data[1].loss_fn_inputs["weights"].WhichOneof("encoding") == "sparse_csr"
    assert_tensor(batch.data[1].loss_fn_inputs["weights"], [[0, 1, 0, 0], [0, 0, 0, 0]], "float32")


def test_garbage_is_not_a_forward_backward_request() -> None:
    for raw in (b"garbage", b'{"model_id": "m", "seq_id": 1}', b"\x0a\xff"):
        with pytest.raises(
            UserInputError,
            match=r"^body: not a tinker_public\."
            r"ForwardBackwardRequest protobuf",
        ):
            parse_forward_backward(raw)


@pytest.mark.parametrize("loss_fn", ["mse", "rloo", ""])
def test_unsupported_loss_fns(loss_fn: str) -> None:
    request = good_request()
    request.loss_fn = loss_fn
    message = batch_error(request)
    assert message.startswith(f"loss_fn: {loss_fn!r} is not a built-in loss function")
    assert all(fn.value in message for fn in LossFn)


def test_custom_without_an_uploaded_loss_is_refused_naming_loss_id() -> None:
    """loss_fn "custom" runs a create_custom_loss upload: without one it names loss_id."""
    request = good_request()
    request.loss_fn = "custom"
    assert batch_error(request).startswith("loss_fn_config.loss_id: loss_fn 'custom' runs")


def test_a_text_config_value_from_the_sdk() -> None:
    body = sdk_body(
        [text_datum([1, 2], target_tokens=[2, 3])], "cross_entropy", {"scale": 2.0, "mode": "fast"}
    )
    with pytest.raises(UserInputError, match=r"^loss_fn_config_v2\['mode'\]: must be a number"):
        parse_forward_backward(body).batch()


def test_image_chunks_convert_and_dmel_chunks_are_refused() -> None:
    """The SDK's ImageChunk arrives as ours (its bytes checked with the batch's sizes); a
    dmel chunk is refused naming it."""
    image = text_datum(
        sdk.ModelInput(
            chunks=[
                sdk.EncodedTextChunk(tokens=[1, 2]),
                sdk.ImageChunk(data=b"\x89PNG fake", format="png", expected_tokens=4),
            ]
        ),
        target_tokens=[2, 3],
    )
    (datum,) = parse_forward_backward(sdk_body([image])).batch().data
    png = ImageChunk(data=b"\x89PNG fake", format="png", expected_tokens=4)
    assert datum.model_input.chunks[1] == png and datum.model_input.length == 6
    dmel = text_datum(sdk.ModelInput(chunks=[sdk.DmelChunk(dmel=b"\x00" * 8)]), target_tokens=[2])
    with pytest.raises(UserInputError, match=r"^data\[1\]\.model_input\.chunks\[0\]: dmel chunks"):
        parse_forward_backward(sdk_body([text_datum([1], target_tokens=[2]), dmel])).batch()


def test_token_bytes_must_be_whole_int32s() -> None:
    request = good_request()
    request.data[1].model_input[0].encoded_text.tokens += b"\x01"
    error = batch_error(request)
    assert error.startswith("data[1].model_input.chunks[0].encoded_text.tokens: 9 bytes")


def test_a_chunk_must_hold_something() -> None:
    request = good_request()
    request.data[0].model_input.add()
    error = "data[0].model_input.chunks[1]: empty chunk (set encoded_text or image)"
    assert batch_error(request) == error


def test_tensor_dtype_must_be_given() -> None:
    request = good_request()
    request.data[0].loss_fn_inputs["weights"].dtype = pb.DTYPE_UNSPECIFIED
    assert batch_error(request).startswith(
        "data[0].loss_fn_inputs['weights']: dtype DTYPE_UNSPECIFIED is not supported"
    )


def test_dense_bytes_must_match_dtype_and_shape() -> None:
    request = good_request()
    request.data[0].loss_fn_inputs["weights"].dense += b"\x00\x00"
    assert batch_error(request).startswith(
        "data[0].loss_fn_inputs['weights'].dense: 14 bytes is not a whole number"
    )

    request = good_request()
    request.data[0].loss_fn_inputs["target_tokens"].shape[:] = [4]
    assert batch_error(request).startswith(
        "data[0].loss_fn_inputs['target_tokens']: dense holds 3 values but shape [4] needs 4"
    )


@pytest.mark.parametrize(
    ("mutate", "problem"),
    [
        (
            lambda t: t.sparse_csr.__setattr__("col_indices", np.array([4], "<i8").tobytes()),
            "col_indices out of range",
        ),
        (
            lambda t: t.sparse_csr.__setattr__("col_indices", np.array([-1], "<i8").tobytes()),
            "col_indices out of range",
        ),
        (lambda t: t.shape.__setitem__(slice(None), [8]), "needs a 2-D shape"),
        (lambda t: t.shape.__setitem__(slice(None), [3, 4]), "crow_indices has 3 entries"),
        (lambda t: t.sparse_csr.__setattr__("values", b""), "values has 0 entries"),
        (
            lambda t: t.sparse_csr.__setattr__(
                "crow_indices", np.array([0, 2, 1], "<i8").tobytes()
            ),
            "crow_indices must start at 0",
        ),
        (
            lambda t: t.sparse_csr.__setattr__("crow_indices", b"\x00" * 7),
            "crow_indices: 7 bytes is not a whole number",
        ),
        (lambda t: t.shape.__setitem__(slice(None), [1 << 20, 1 << 20]), "is too large"),
    ],
)
def test_bad_sparse_csr(mutate: Any, problem: str) -> None:
    request = good_request()
    mutate(request.data[1].loss_fn_inputs["weights"])
    message = batch_error(request)
    assert message.startswith("data[1].loss_fn_inputs['weights']: sparse_csr"), message
    assert problem in message, message


# ---- results, read by the SDK ----


def td(values: Any, dtype: str) -> TensorData:
    return TensorData.from_numpy(np.asarray(values, dtype=dtype))


def sdk_read(raw: bytes, model_cls: type) -> Any:
    """What the SDK's retrieve_future does with a protobuf success body."""
    return deserialize_proto_response(raw, model_cls)


def test_forward_backward_output_as_the_sdk_reads_it() -> None:
    outputs = [
        {
            "logprobs": td([-0.5, -1.0, -2.0], "float32"),
            "elementwise_loss": td([1, 2, 3], "float32"),
            "argmax": td([4, 5, 6], "int64"),
            "topk": td(np.arange(6).reshape(3, 2), "float32"),
        },
        {
            "logprobs": td([-0.25], "float32"),
            "elementwise_loss": td([0.5], "float32"),
            "argmax": td([151_000], "int64"),
            "topk": td([[7, 8]], "float32"),
        },
        {
            "logprobs": td([-3.0, -4.0, -5.0, -6.0, -7.0], "float32"),
            "elementwise_loss": td([0, 0, 0, 0, 1], "float32"),
            "argmax": td([1, 2, 3, 4, 5], "int64"),
            "topk": td(np.arange(10).reshape(5, 2), "float32"),
        },
    ]
    ours = ForwardBackwardOutput(
        loss_fn_outputs=outputs, metrics={"loss:sum": 3.5, "tokens:sum": 9.0}
    )
    raw = encode_forward_backward_output(ours)

    [record] = pb.ForwardBackwardOutput.FromString(raw).loss_fn_outputs
    assert record.num_datums == 3
    assert np.frombuffer(record.fields["logprobs"].offsets, "<i8").tolist() == [0, 12, 16, 36]
    assert list(record.fields["topk"].trailing_shape) == [2]

    theirs = sdk_read(raw, sdk.ForwardBackwardOutput)
    assert theirs.loss_fn_output_type == "ArrayRecord"
    assert theirs.metrics == {"loss:sum": 3.5, "tokens:sum": 9.0}
    assert len(theirs.loss_fn_outputs) == 3
    for mine, sdk_datum in zip(outputs, theirs.loss_fn_outputs, strict=True):
        assert sdk_datum.keys() == mine.keys()
        for name, tensor in mine.items():
            assert sdk_datum[name].dtype == tensor.dtype
            assert sdk_datum[name].shape == list(tensor.data.shape)
            np.testing.assert_array_equal(sdk_datum[name].to_numpy(), tensor.data)

    # Chunks of one call, merged by the SDK: outputs concatenate, metrics reduce by suffix.
    merged = combine_fwd_bwd_output_results([theirs, theirs])
    assert len(merged.loss_fn_outputs) == 6
    assert merged.metrics == {"loss:sum": 7.0, "tokens:sum": 18.0}


def test_an_empty_forward_backward_output() -> None:
    theirs = sdk_read(
        encode_forward_backward_output(ForwardBackwardOutput(loss_fn_outputs=[])),
        sdk.ForwardBackwardOutput,
    )
    assert theirs.loss_fn_outputs == [] and theirs.metrics == {}


def test_datums_must_share_output_fields() -> None:
    out = ForwardBackwardOutput(
        loss_fn_outputs=[{"logprobs": td([-1.0], "float32")}, {"other": td([-1.0], "float32")}]
    )
    with pytest.raises(AssertionError):
        encode_forward_backward_output(out)


def sample_response(prompt_logprobs: list[float | None] | None) -> SampleResponse:
    return SampleResponse(
        sequences=[
            SampledSequence(stop_reason="stop", tokens=[11, 151_643], logprobs=[-0.5, -0.125]),
            SampledSequence(stop_reason="length", tokens=[3, 4, 5], logprobs=[-1.0, -2.0, -3.0]),
        ],
        prompt_logprobs=prompt_logprobs,
    )


def test_sample_response_as_the_sdk_reads_it() -> None:
    theirs = sdk_read(encode_sample_response(sample_response(None)), sdk.SampleResponse)
    assert [s.stop_reason for s in theirs.sequences] == ["stop", "length"]
    assert [s.tokens for s in theirs.sequences] == [[11, 151_643], [3, 4, 5]]
    assert [s.logprobs for s in theirs.sequences] == [[-0.5, -0.125], [-1.0, -2.0, -3.0]]
    assert theirs.prompt_logprobs is None


def test_prompt_logprobs_as_the_sdk_reads_them() -> None:
    ours = sample_response([None, -1.5, -0.25, -4.0, -2.0])
    theirs = sdk_read(encode_sample_response(ours), sdk.SampleResponse)
    assert theirs.prompt_logprobs == [None, -1.5, -0.25, -4.0, -2.0]

    raw = encode_sample_response(ours, prompt_logprobs_last_n=2)
    theirs = sdk_read(raw, sdk.SampleResponse)
    assert theirs.prompt_logprobs == [None, None, None, -4.0, -2.0]
    _check_prompt_logprobs_last_n_honored(theirs, 2)  # the SDK's own check passes
    with pytest.raises(RuntimeError):  # and it would have caught an unmasked answer
        _check_prompt_logprobs_last_n_honored(
            sdk_read(encode_sample_response(ours), sdk.SampleResponse), 2
        )

    longer = sdk_read(encode_sample_response(ours, prompt_logprobs_last_n=10), sdk.SampleResponse)
    assert longer.prompt_logprobs == [None, -1.5, -0.25, -4.0, -2.0]
    assert all(math.isfinite(v) for v in longer.prompt_logprobs[1:])


# ---- the schema ----


def _shape(message: Any) -> dict[str, Any]:
    """A message's wire-relevant schema, comparable across descriptor pools and packages."""
    fields = {
        f.name: (
            f.number,
            f.type,
            f.is_repeated,
            f.has_presence,
            f.containing_oneof.name if f.containing_oneof else None,
            f.message_type.name if f.message_type else None,
            f.enum_type.name if f.enum_type else None,
        )
        for f in message.fields
    }
    nested = {n.name: _shape(n) for n in message.nested_types}
    return {"fields": fields, "nested": nested}


def test_our_proto_matches_the_sdks() -> None:
    ours, theirs = pb.DESCRIPTOR, sdk_pb.DESCRIPTOR
    assert set(ours.message_types_by_name) == set(theirs.message_types_by_name)
    for name, message in theirs.message_types_by_name.items():
        assert _shape(ours.message_types_by_name[name]) == _shape(message), name
    assert set(ours.enum_types_by_name) == set(theirs.enum_types_by_name)
    for name, enum in theirs.enum_types_by_name.items():
        mine = ours.enum_types_by_name[name]
        assert {v.name: v.number for v in mine.values} == {v.name: v.number for v in enum.values}, (
            name
        )


# --- sizes before materialisation --------------------------------------------------------------
def peak_bytes(work: Callable[[], Any]) -> int:
    """The most memory Python and numpy allocated at once while `work` ran (tracemalloc sees
    both)."""
    import tracemalloc

    tracemalloc.start()
    try:
        work()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


def test_an_oversize_datum_is_refused_from_its_byte_length() -> None:
    """A 40 MB protobuf datum of 10M tokens (QT_MAX_TOKENS_PER_DATUM is 32768) is refused from
    its field lengths on the wire, unparsed: under 1 MB allocated (converting it to ints took
    ~400 MB, and even parsing it held the interpreter lock ~70 ms); its envelope is still read,
    so the gateway can use its seq_id. A loss input's dense bytes are counted too."""
    big = np.zeros(10_000_000, dtype="<i4").tobytes()
    request = pb.ForwardBackwardRequest(
        model_id="m-big", seq_id=7, loss_fn="cross_entropy", forward_only=True
    )
    request.data.add().model_input.add().encoded_text.tokens = big
    raw = request.SerializeToString()
    parsed: list[Any] = []

    def refuse() -> None:
        parsed.append(parse_forward_backward(raw))
        with pytest.raises(
            UserInputError, match=r"^data\[0\]\.model_input: 10000000 tokens is more"
        ):
            parsed[0].batch()

    assert peak_bytes(refuse) < 1e6
    assert (parsed[0].model_id, parsed[0].seq_id, parsed[0].forward_only) == ("m-big", 7, True)
    request = pb.ForwardBackwardRequest(model_id="m", seq_id=1, loss_fn="cross_entropy")
    item = request.data.add()
    item.model_input.add().encoded_text.tokens = np.arange(3, dtype="<i4").tobytes()
    weights = item.loss_fn_inputs["weights"]
    weights.dtype, weights.dense = pb.DTYPE_FLOAT32, big
    with pytest.raises(
        UserInputError, match=r"^data\[0\]\.loss_fn_inputs\['weights'\]: 10000000 values"
    ):
        parse_forward_backward(request.SerializeToString()).batch()


def test_an_oversize_json_prompt_is_refused_before_validation() -> None:
    """A sample prompt of 2M tokens in JSON is refused from its list lengths, before pydantic
    turns each into an int (the conversion's peak was hundreds of MB)."""
    from queue_tinker.types.requests.request_limits import RequestLimits
    from queue_tinker.types.requests.sampling import sample_input

    prompt = {"chunks": [{"tokens": list(range(1_000_000))}, {"tokens": [1] * 1_000_000}]}

    def refuse() -> None:
        with pytest.raises(UserInputError, match=r"^prompt: 2000000 tokens is more"):
            sample_input(prompt, 1, {"max_tokens": 4}, False, None, limits=RequestLimits.defaults())

    assert peak_bytes(refuse) < 1e6
