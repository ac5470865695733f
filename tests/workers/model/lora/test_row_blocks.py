"""Row blocks (workers/model/lora/row_blocks.py) against PEFT's own LoRA layer: one block of every
row computes what PEFT's forward computes, to the bit and in the base layer's dtype (fp32 and a
bf16 base under fp32 adapters); several blocks compute what each block's rows compute alone
under their own adapter; a block whose adapter does not adapt the layer gets the base output."""

from __future__ import annotations

import pytest
import torch
from engine_driver import saved_bytes
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import Linear as LoraLinear

from queue_tinker.workers.model.lora.row_blocks import lora_layers_of, row_blocks


class Two(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(16, 24, bias=False)
        self.down = torch.nn.Linear(24, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def model(base_dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    net = get_peft_model(Two(), LoraConfig(r=4, lora_alpha=8, target_modules=["up", "down"]))
    net.add_adapter("b", LoraConfig(r=2, lora_alpha=8, target_modules=["up"]))
    with torch.no_grad():  # B starts at zero: give both adapters an update that counts
        for name, param in net.named_parameters():
            if "lora_B" in name:
                param.normal_()
    for layer in lora_layers_of(net):
        layer.base_layer.to(base_dtype)  # the adapters stay fp32, as on a bf16 worker
    return net


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_block_is_peft_s_own_forward(dtype: torch.dtype) -> None:
    net = model(dtype)
    net.set_adapter("default")
    layer = net.base_model.model.up
    assert isinstance(layer, LoraLinear)
    x = torch.randn(6, 16, dtype=dtype)
    want = layer(x)
    with row_blocks([layer], [("default", 6)]):
        got = layer(x)
    assert got.dtype == want.dtype == dtype
    assert torch.equal(got, want)


def test_several_blocks_compute_each_block_alone() -> None:
    net = model(torch.float32)
    layers = lora_layers_of(net)
    x = torch.randn(7, 16)
    with row_blocks(layers, [("default", 3), ("b", 2), ("__base__", 2)]):
        mixed = net(x)
    net.set_adapter("default")
    first = net(x[:3])
    net.set_adapter("b")
    second = net(x[3:5])
    with net.disable_adapter():
        base = net(x[5:])
    torch.testing.assert_close(mixed, torch.cat([first, second, base]), rtol=1e-6, atol=1e-6)


def test_lora_matmuls_in_the_base_dtype_match_autocast_and_keep_no_fp32_copy() -> None:
    """QT_LORA_MATMUL_DTYPE=auto on a bf16 base: the update is computed in bf16 from the fp32
    weights, as torch's autocast computes it (values and fp32 gradients to the bit), it comes
    within bf16 rounding of the fp32 update, and backward keeps less: no fp32 copy of the
    input, only the bf16 tensor and the rank-wide intermediate."""
    net = model(torch.bfloat16)
    layers = lora_layers_of(net)
    layer = net.base_model.model.up
    x = torch.randn(6, 16, dtype=torch.bfloat16, requires_grad=True)
    params = [
        p for n, p in net.named_parameters() if "lora_" in n and ".default." in n and ".up." in n
    ]

    def run(compute: torch.dtype | None) -> tuple[torch.Tensor, int, list[torch.Tensor]]:
        for p in params:
            p.grad = None
        with row_blocks(layers, [("default", 6)], compute):
            out, kept = saved_bytes(lambda: layer(x))
        out.float().square().sum().backward()
        return out, kept, [p.grad.clone() for p in params if p.grad is not None]

    low, low_kept, low_grads = run(torch.bfloat16)
    wide, wide_kept, wide_grads = run(None)
    for p in params:
        p.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        base = layer.base_layer(x)
        update = layer.lora_B["default"](layer.lora_A["default"](x)) * layer.scaling["default"]
    reference = base + update
    reference.float().square().sum().backward()
    assert low.dtype == torch.bfloat16 and torch.equal(low, reference)
    assert all(g.dtype == torch.float32 for g in low_grads) and len(low_grads) == 2
    for got, want in zip(low_grads, [p.grad for p in params], strict=True):
        assert want is not None and torch.equal(got, want)
    torch.testing.assert_close(low.float(), wide.float(), rtol=2e-2, atol=2e-2)
    for got, want in zip(low_grads, wide_grads, strict=True):
        assert float((got - want).norm() / want.norm()) < 2e-2
    assert low_kept + 6 * 16 * 4 <= wide_kept  # the fp32 copy of x is gone
