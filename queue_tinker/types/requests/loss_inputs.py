"""What each built-in loss needs, and the checks every forward/forward_backward batch passes.

The checks run at the client (before anything is queued) and again on the worker (the gateway
and other clients may send anything); both use this one function. Messages name the datum,
the field and what is wrong, because a user reads them far from where the batch was built.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import numpy as np

from queue_tinker.errors import UserInputError
from queue_tinker.types.enums import LossFn
from queue_tinker.types.requests.custom_loss import CustomLoss
from queue_tinker.types.requests.images import check_model_input_images
from queue_tinker.types.requests.request_limits import (
    RequestLimits,
    check_datum_count,
    check_tokens,
)
from queue_tinker.types.requests.training import ForwardBackwardInput
from queue_tinker.types.tensors import Datum, ImageChunk, ModelInput, TensorData


@dataclass(frozen=True)
class LossSpec:
    required: tuple[str, ...]
    optional: tuple[str, ...] = ()
    config: Mapping[str, float | None] = field(default_factory=dict)  # default; None: required
    open_inputs: bool = False  # takes any further inputs (a custom loss names its own)

    @property
    def inputs(self) -> tuple[str, ...]:
        return self.required + self.optional


# Tinker's documentation lists target_tokens, logprobs and advantages for every RL loss and says
# nothing of weights. As the peer servers do, advantages may be left out (zeros: the loss is then
# only a DRO penalty, else zero) and weights are taken by every loss, as a per-token scale
# (0 masks a token out). docs/losses.md says so.
_POLICY = ("target_tokens", "logprobs")
_POLICY_OPTIONAL = ("advantages", "weights")
_CLIP = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
# Tinker's DRO page shows beta only as a custom value (0.05), and the SDK and the cookbook send
# no loss_fn_config by default; that value is the default here, so a call without config works.
_DRO = {"beta": 0.05}

LOSS_SPECS: dict[LossFn, LossSpec] = {
    LossFn.CROSS_ENTROPY: LossSpec(("target_tokens",), optional=("weights",)),
    LossFn.IMPORTANCE_SAMPLING: LossSpec(_POLICY, _POLICY_OPTIONAL),
    LossFn.PPO: LossSpec(_POLICY, _POLICY_OPTIONAL, config=_CLIP),
    LossFn.CISPO: LossSpec(_POLICY, _POLICY_OPTIONAL, config=_CLIP),
    LossFn.DRO: LossSpec(_POLICY, _POLICY_OPTIONAL, config=_DRO),
    LossFn.GSPO: LossSpec(_POLICY, (*_POLICY_OPTIONAL, "sequence_ratio_mask"), config=_CLIP),
    LossFn.STABLE_REINFORCE: LossSpec(_POLICY, _POLICY_OPTIONAL),
    LossFn.CUSTOM: LossSpec(("target_tokens",), open_inputs=True),
}
assert set(LOSS_SPECS) == set(LossFn), "every LossFn needs a LossSpec"

FLOAT_INPUTS = ("weights", "logprobs", "advantages", "sequence_ratio_mask")


def parse_loss_fn(loss_fn: object) -> LossFn:
    # Every LossFn value is a str, so anything else is refused like an unknown name.
    if isinstance(loss_fn, str):
        try:
            return LossFn(loss_fn)
        except ValueError:
            pass
    names = ", ".join(f.value for f in LossFn)
    raise UserInputError(
        f"loss_fn: {loss_fn!r} is not a built-in loss function; choose one of {names} "
        "(or use forward_backward_custom)"
    )


def resolve_loss_config(loss_fn: LossFn, config: Mapping[str, object] | None) -> dict[str, float]:
    """The loss's config with defaults filled in; unknown keys and bad values refused."""
    spec = LOSS_SPECS[loss_fn]
    given = dict(config or {})
    unknown = sorted(set(given) - set(spec.config))
    if unknown:
        allowed = ", ".join(spec.config) or "none"
        raise UserInputError(
            f"loss_fn_config: {unknown} not used by {loss_fn.value} (it takes: {allowed})"
        )
    resolved = {
        key: _config_number(loss_fn, key, given.get(key, default))
        for key, default in spec.config.items()
    }
    _check_config_ranges(resolved)
    return resolved


def _config_number(loss_fn: LossFn, key: str, value: object) -> float:
    """One config value (given, or its default) as a float: present and a finite number."""
    if value is None:
        raise UserInputError(f"loss_fn_config.{key}: required by {loss_fn.value}")
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise UserInputError(f"loss_fn_config.{key}: must be a finite number, got {value!r}")
    return float(value)


def _check_config_ranges(resolved: Mapping[str, float]) -> None:
    """The clip thresholds around 1 and beta not negative, where the loss takes them."""
    low, high = resolved.get("clip_low_threshold"), resolved.get("clip_high_threshold")
    if low is not None and high is not None and not 0 <= low <= 1 <= high:
        raise UserInputError(
            f"loss_fn_config: need 0 <= clip_low_threshold <= 1 <= clip_high_threshold, "
            f"got {low} and {high}"
        )
    if resolved.get("beta", 0.0) < 0:
        raise UserInputError(f"loss_fn_config.beta: must be >= 0, got {resolved['beta']}")


@dataclass(frozen=True)
class ModelLimits:
    """What only the model knows; None where the checker does not know it (the client)."""

    vocab_size: int | None = None
    context_length: int | None = None
    capped: bool = False  # context_length is the cap of a Base:peft:<tokens> name

    def with_cap(self, cap: int | None) -> ModelLimits:
        """These limits under a :peft:<tokens> cap (None: none); the worker has refused a cap
        above the model's own context before any op runs under it."""
        if cap is None or (self.context_length is not None and self.context_length < cap):
            return self
        return replace(self, context_length=cap, capped=True)

    @property
    def context_text(self) -> str:
        """The context as an error names it."""
        if self.capped:
            return f"the context cap of {self.context_length} (its base model's :peft:)"
        return f"the model's context of {self.context_length}"


def check_batch_size(batch: ForwardBackwardInput, limits: RequestLimits) -> None:
    """A forward / forward_backward batch: datums per request, tokens per datum (its
    model_input and each loss_fn_input)."""
    check_datum_count(len(batch.data), limits)
    for index, datum in enumerate(batch.data):
        where = f"data[{index}]"
        check_training_images(f"{where}.model_input", datum.model_input, limits)
        check_tokens(f"{where}.model_input", datum.model_input.length, limits)
        for key, tensor in datum.loss_fn_inputs.items():
            check_tokens(
                f"{where}.loss_fn_inputs[{key!r}]", int(tensor.data.size), limits, what="values"
            )


def check_training_images(where: str, model_input: ModelInput, limits: RequestLimits) -> None:
    """A training datum's images: each within the image limits, and each saying the positions
    it takes (expected_tokens), which its loss_fn_inputs are aligned with."""
    check_model_input_images(where, model_input, limits)
    for index, chunk in enumerate(model_input.chunks):
        if isinstance(chunk, ImageChunk) and chunk.expected_tokens is None:
            raise UserInputError(
                f"{where}.chunks[{index}].expected_tokens: required for an image in a training "
                "datum: its loss_fn_inputs are aligned with the positions the image takes"
            )


def check_batch(batch: ForwardBackwardInput, limits: ModelLimits = ModelLimits()) -> None:
    """Raise UserInputError naming the first problem in the batch."""
    if not batch.data:
        raise UserInputError("data: the batch is empty; pass at least one Datum")
    resolve_loss_config(batch.loss_fn, batch.loss_fn_config)
    custom = batch.custom_loss
    for index, datum in enumerate(batch.data):
        check_datum(index, datum, batch.loss_fn, limits)
        if custom is not None:
            check_custom_inputs(index, datum, custom)


def check_custom_inputs(index: int, datum: Datum, custom: CustomLoss) -> None:
    for name in custom.input_names:
        if name not in datum.loss_fn_inputs:
            raise UserInputError(
                f"data[{index}].loss_fn_inputs: missing {name!r}, which "
                f"the custom loss {custom.name!r} reads"
            )


def check_datum(index: int, datum: Datum, loss_fn: LossFn, limits: ModelLimits) -> None:
    where = f"data[{index}]"
    tokens = datum.model_input.text_ints()  # images: their positions, counted on the worker
    n = datum.model_input.length
    if n == 0:
        raise UserInputError(f"{where}.model_input: has no tokens")
    if limits.context_length is not None and n > limits.context_length:
        raise UserInputError(
            f"{where}.model_input: {n} tokens is longer than {limits.context_text}"
        )
    if limits.vocab_size is not None:
        check_token_ids(f"{where}.model_input", np.asarray(tokens), limits.vocab_size)
    _check_loss_inputs(where, datum, loss_fn, n, limits)


def _check_loss_inputs(
    where: str, datum: Datum, loss_fn: LossFn, n_input: int, limits: ModelLimits
) -> None:
    inputs = datum.loss_fn_inputs
    _check_input_names(where, set(inputs), loss_fn)
    targets = inputs["target_tokens"]
    length = targets.data.size
    for key, tensor in inputs.items():
        _check_loss_input(where, key, tensor, length)
    mask = inputs.get("sequence_ratio_mask")
    if mask is not None and not np.any(mask.data != 0):
        raise UserInputError(
            f"{where}.loss_fn_inputs['sequence_ratio_mask']: marks no token; the sequence ratio "
            "is a mean over the marked tokens, so mark at least one (or leave it out: all)"
        )
    if targets.dtype != "int64":
        raise UserInputError(f"{where}.loss_fn_inputs['target_tokens']: must be int64 token ids")
    if not 1 <= length <= n_input:
        raise UserInputError(
            f"{where}.loss_fn_inputs['target_tokens']: has {length} values for a model_input "
            f"of {n_input} tokens; position i predicts token i+1, so give 1 to {n_input}"
        )
    if limits.vocab_size is not None:
        check_token_ids(f"{where}.loss_fn_inputs['target_tokens']", targets.data, limits.vocab_size)


def _check_loss_input(where: str, key: str, tensor: TensorData, length: int) -> None:
    """One loss_fn_inputs tensor: 1-D, as long as target_tokens, finite where it is a float."""
    name = f"{where}.loss_fn_inputs[{key!r}]"
    if tensor.data.ndim != 1:
        raise UserInputError(f"{name}: must be 1-D, got shape {list(tensor.data.shape)}")
    if tensor.data.size != length:
        raise UserInputError(
            f"{where}.loss_fn_inputs: {key} has {tensor.data.size} values but "
            f"target_tokens has {length}; they must be the same length"
        )
    if key in FLOAT_INPUTS:
        bad = np.flatnonzero(~np.isfinite(tensor.data))
        if bad.size:
            raise UserInputError(
                f"{name}: value at position {int(bad[0])} is {tensor.data[bad[0]]}; must be finite"
            )


def _check_input_names(where: str, names: set[str], loss_fn: LossFn) -> None:
    spec = LOSS_SPECS[loss_fn]
    takes = ", ".join(spec.inputs)
    for key in spec.required:
        if key not in names:
            raise UserInputError(
                f"{where}.loss_fn_inputs: missing {key!r}, required by {loss_fn.value} "
                f"(it takes {takes})"
            )
    for key in sorted(names - set(spec.inputs)) if not spec.open_inputs else ():
        raise UserInputError(
            f"{where}.loss_fn_inputs[{key!r}]: not an input of {loss_fn.value} (it takes {takes})"
        )


def check_token_ids(name: str, ids: np.ndarray, vocab_size: int) -> None:
    bad = np.flatnonzero((ids < 0) | (ids >= vocab_size))
    if bad.size:
        raise UserInputError(
            f"{name}: token id {int(ids[bad[0]])} at position {int(bad[0])} is outside the "
            f"vocabulary (0 to {vocab_size - 1})"
        )
