"""LoRA on stacked experts (workers/model/lora/expert_lora.py and adapters.stacked_experts): which
weights count as experts, and the folded weight against PEFT's own delta."""

from __future__ import annotations

import warnings

import torch
from peft import LoraConfig, get_peft_model
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from queue_tinker.workers.model.adapters import expert_parameters, stacked_experts
from queue_tinker.workers.model.lora.expert_lora import chain_of, folded_weight, outermost_wrappers

CONFIG = Qwen3MoeConfig(
    hidden_size=16,
    moe_intermediate_size=8,
    num_experts=4,
    num_experts_per_tok=2,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    vocab_size=10,
)


def test_only_a_modules_stacked_experts_count() -> None:
    """Qwen3-MoE's two 3-D expert weights are experts; a Conv1d's 3-D weight is not."""
    model = Qwen3MoeForCausalLM(CONFIG)
    model.add_module("conv", torch.nn.Conv1d(4, 4, 3))
    names = [name for name, _ in stacked_experts(model)]
    assert names == [
        "model.layers.0.mlp.experts.gate_up_proj",
        "model.layers.0.mlp.experts.down_proj",
    ]
    assert expert_parameters(model) == {"experts.gate_up_proj", "experts.down_proj"}


def test_the_folded_weight_is_the_parameter_plus_peft_s_delta() -> None:
    """Each nested wrapper's fold is its parameter plus PEFT's get_delta_weight (nonzero B)."""
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(CONFIG)
    cfg = LoraConfig(r=2, target_modules=[], target_parameters=sorted(expert_parameters(model)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft = get_peft_model(model, cfg, adapter_name="x")
    [outer] = outermost_wrappers(peft)
    chain, experts = chain_of(outer)
    assert [w.parameter_name for w in chain] == ["down_proj", "gate_up_proj"]
    assert type(experts).__name__ == "Qwen3MoeExperts"
    with torch.no_grad():
        for wrapper in chain:
            wrapper.lora_B["x"].weight.normal_()
            want = wrapper.get_param() + wrapper.get_delta_weight("x")
            torch.testing.assert_close(folded_weight(wrapper, "x"), want, rtol=1e-5, atol=1e-6)
