"""Quantized checkpoints load dequantized (model/base_model.py `dequantized`): an MXFP4
gpt-oss checkpoint, as OpenAI ships gpt-oss-20b / 120b (each expert matrix in blocks of 32 FP4
values with a shared power-of-two scale), made here from the tiny built-in and read back
through the worker's loader, against the format decoded by hand."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from queue_tinker.workers.model.base_model import (
    dequantized,
    ensure_builtin_model,
    load_base_model,
    load_config,
)

GPT_OSS = "queue-tinker/tiny-gpt-oss"
# FP4 (e2m1) by its 4-bit code: sign, 2 exponent bits, 1 mantissa bit.
FP4 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
GROUP = 32  # values a scale covers


def quantize_experts(
    weight: torch.Tensor, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random MXFP4 blocks and scales for an (experts, in, out) parameter, and the weight they
    stand for: blocks (experts, out, in / 32, 16) two codes a byte, the low nibble first;
    scales (experts, out, in / 32) as 127 + the power of two."""
    experts, inputs, outputs = weight.shape
    groups = inputs // GROUP
    codes = torch.randint(0, 16, (experts, outputs, groups, GROUP), generator=generator)
    exponents = torch.randint(-3, 2, (experts, outputs, groups), generator=generator)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    scales = (exponents + 127).to(torch.uint8)
    values = torch.tensor(FP4)[codes] * torch.exp2(exponents.float())[..., None]
    return blocks, scales, values.reshape(experts, outputs, inputs).transpose(1, 2)


@pytest.fixture(scope="module")
def mxfp4_checkpoint(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, dict[str, torch.Tensor]]:
    root = tmp_path_factory.mktemp("mxfp4")
    source = ensure_builtin_model(GPT_OSS, root / "models")
    path = root / "tiny-gpt-oss-mxfp4"
    shutil.copytree(source, path)
    tensors = load_file(path / "model.safetensors")
    generator = torch.Generator().manual_seed(0)
    expected = {}
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales, expected[name] = quantize_experts(tensors.pop(name), generator)
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    (path / "config.json").write_text(json.dumps(config))
    assert len(expected) == 4  # 2 layers x (gate_up, down)
    return path, expected


def test_an_mxfp4_checkpoint_loads_as_the_weights_its_blocks_encode(
    mxfp4_checkpoint: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    """Every expert matrix equals its blocks decoded by hand (FP4 times its group's power of
    two: exact in fp32), held as plain 3-D weights LoRA's target_parameters can wrap; the
    model runs."""
    path, expected = mxfp4_checkpoint
    model = load_base_model(str(path), "cpu", path.parent / "models", dtype="fp32")
    params = dict(model.named_parameters())
    for name, want in expected.items():
        got = params[name]
        assert got.dtype == torch.float32 and got.shape == want.shape, name
        assert torch.equal(got, want), name
    logits = model(input_ids=torch.tensor([[5, 6, 7, 8]])).logits
    assert torch.isfinite(logits).all()


def test_the_loader_asks_transformers_to_dequantize_whatever_is_installed(
    mxfp4_checkpoint: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    """transformers keeps MXFP4 (which it cannot train) where the `kernels` package is
    installed: the loader always asks for dequantized weights, keeping the checkpoint's
    settings; an unquantized checkpoint loads as it is."""
    path, _ = mxfp4_checkpoint
    asked = dequantized(load_config(str(path)))
    assert asked is not None and asked.quant_method == "mxfp4"
    assert asked.get_loading_attributes() == {"dequantize": True}
    assert asked.to_dict()["modules_to_not_convert"][0] == "model.layers.*.self_attn"
    plain = ensure_builtin_model(GPT_OSS, path.parent / "models")
    assert dequantized(load_config(str(plain))) is None
