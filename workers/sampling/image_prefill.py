"""The prefill of a prompt that holds images (a vision-language model's): alone, one row.

Its image placeholders take the vision tower's embeddings, and its positions are the model's
3-D rotary ones (text counts on from each image's largest position), so the row's next
position is that largest one plus one, not its length. From there its decode steps are a text
row's like any other: the decode loop feeds each step's token at `next_pos`, which the model
reads as the same position on all three axes, as its own generate() does. Such a prompt is
never shared with another request (two prompts with the same ids may hold different images),
and is not batched with other prompts in its prefill.
"""

from __future__ import annotations

from typing import cast

import torch
from peft import PeftModel
from transformers import PreTrainedModel

from queue_tinker.workers.model.vision_language import joined, rope_positions
from queue_tinker.workers.sampling.decode_rows import LiveRequest, Rows, fresh_cache, select_rows
from queue_tinker.workers.sampling.host_reads import to_device
from queue_tinker.workers.sampling.model_call import ModelCall
from queue_tinker.workers.sampling.prompt_scores import prompt_scores, wants_prompt_scores


def prefill_with_images(
    forward: ModelCall,
    model: torch.nn.Module,
    request: LiveRequest,
    samples: range,
    device: torch.device,
) -> tuple[Rows, torch.Tensor]:
    """The request's prompt prefilled, its cache expanded to one row per sample in `samples`;
    the rows, and the logits they choose their first tokens from."""
    spec = request.spec
    assert spec.images is not None
    lm = cast(PreTrainedModel, model.get_base_model() if isinstance(model, PeftModel) else model)
    ids = to_device([spec.prompt], torch.long, device)
    mask = torch.ones_like(ids)
    images = joined([spec.images], device, lm.dtype)
    assert images is not None
    positions = rope_positions(ids, mask, images)
    wanted = wants_prompt_scores(spec) and samples.start == 0
    cache = fresh_cache(model)
    logits = forward(
        model, ids, mask, positions, cache, [request.adapter], not wanted, images.kwargs
    )
    request.prefilled += len(spec.prompt)
    if wanted:
        request.prompt_scores = prompt_scores(logits[0], spec)
    index = torch.zeros(len(samples), dtype=torch.long, device=device)
    if len(samples) > 1:
        select_rows(cache, index)
    next_pos = positions.amax(dim=(0, 2)) + 1  # (1,): after the largest position on any axis
    rows = Rows.build(
        requests=[request] * len(samples),
        samples=list(samples),
        cache=cache,
        mask=mask[index],
        next_pos=next_pos[index],
    )
    return rows, logits[:, -1][index]
