"""The adapter pool of one rank of a sharded worker group: LoRA tensors split as the base model's
layers are (lora_shards.py), state in and out whole, so snapshots, checkpoints and a fresh
adapter's first weights are exactly a one-process worker's.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch
from peft import PeftConfig, get_peft_model
from peft.utils import set_peft_model_state_dict
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, PretrainedConfig

from queue_tinker.errors import UserInputError
from queue_tinker.types.enums import Optimizer
from queue_tinker.types.requests.training import LoraConfig
from queue_tinker.workers.model import lora_shards
from queue_tinker.workers.model.adapters import (
    Adapter,
    AdapterPool,
    adapter_name,
    peft_config,
    peft_deprecation_quiet,
)
from queue_tinker.workers.model.checkpoints import WEIGHTS, AdapterState, CheckpointMeta
from queue_tinker.workers.model.tensor_parallel import Shards


class ShardedAdapterPool(AdapterPool):
    """An AdapterPool over a tensor-parallel base model (tensor_parallel.shard_decoder).
    Every method that moves state is a collective: all ranks call it, in the same order."""

    def __init__(
        self,
        base: torch.nn.Module,
        base_model: str,
        max_resident: int,
        shards: Shards,
        whole_config: PretrainedConfig,
    ) -> None:
        super().__init__(base, base_model, max_resident)
        self.shards = shards
        self.whole_config = whole_config  # the config before sharding: a fresh adapter's shapes
        self.plan = self.family.tensor_parallel  # how its LoRA tensors split, as the base's

    def add(self, model_id: str, tenant_id: str, config: LoraConfig, seed: int) -> Adapter:
        """A fresh adapter whose weights are this rank's part of the ones a one-process worker
        draws from `seed` (PEFT's draws depend on the layers' shapes, so they are made on a
        weightless model of the whole shapes and split)."""
        if config.optimizer is Optimizer.DIMUON:
            raise UserInputError(
                "lora_config.optimizer: 'dimuon' is not served by a sharded worker group: it "
                "orthogonalises each whole LoRA matrix, and the group splits them across ranks; "
                "use 'adamw' or a worker with --ranks 1"
            )
        whole = self._initial_weights(model_id, config, seed)
        adapter = super().add(model_id, tenant_id, config, seed)
        self.load_weights(adapter, whole)
        adapter.grad_norm = partial(lora_shards.grad_norm, shards=self.shards, plan=self.plan)
        for key, param in adapter.params.items():
            if lora_shards.partial_grad(key, self.plan):
                trains = param.requires_grad  # only the active adapter's do; hooks need it
                param.requires_grad_(True)
                param.register_hook(self._sum_over_ranks)
                param.requires_grad_(trains)
        return adapter

    def _sum_over_ranks(self, grad: torch.Tensor) -> torch.Tensor:
        return self.shards.all_reduce(grad.clone())

    def _initial_weights(
        self, model_id: str, config: LoraConfig, seed: int
    ) -> dict[str, torch.Tensor]:
        name = adapter_name(model_id)
        skeleton = _weightless_model(self.whole_config, self.base_model)
        cfg = peft_config(
            self.linear_names, config, self.base_model, self.family, self.expert_parameters
        )
        torch.manual_seed(seed)  # as AdapterPool.add: PEFT draws lora_A from the global generator
        with peft_deprecation_quiet():
            peft = get_peft_model(skeleton, cfg, adapter_name=name)
        marker = f".{name}."
        return {
            n.replace(f".{name}", ""): p.detach().clone()
            for n, p in peft.named_parameters()
            if marker in n
        }

    # --- state in and out: whole outside, split inside --------------------------------------
    def export(self, adapter: Adapter, meta: CheckpointMeta) -> AdapterState:
        state = super().export(adapter, meta)
        state.weights = lora_shards.gather(state.weights, self.shards, self.plan)
        state.exp_avg = lora_shards.gather(state.exp_avg, self.shards, self.plan)
        state.exp_avg_sq = lora_shards.gather(state.exp_avg_sq, self.shards, self.plan)
        state.grads = lora_shards.gather(state.grads, self.shards, self.plan)
        return state

    def load_weights(self, adapter: Adapter, weights: dict[str, torch.Tensor]) -> None:
        super().load_weights(adapter, lora_shards.split(weights, self.shards, self.plan))

    def load_optimizer(self, adapter: Adapter, state: AdapterState) -> None:
        part = AdapterState(
            meta=state.meta,
            weights=state.weights,
            exp_avg=lora_shards.split(state.exp_avg, self.shards, self.plan),
            exp_avg_sq=lora_shards.split(state.exp_avg_sq, self.shards, self.plan),
            grads=state.grads,
        )
        super().load_optimizer(adapter, part)

    def load_grads(self, adapter: Adapter, grads: dict[str, torch.Tensor]) -> None:
        super().load_grads(adapter, lora_shards.split(grads, self.shards, self.plan))

    def _load_frozen(self, directory: Path, name: str) -> None:
        """PEFT's loaders check shapes against the whole files: add the adapter from its
        config, then load this rank's part of the files."""
        cfg = PeftConfig.from_pretrained(str(directory))
        cfg.inference_mode = True
        self._attach(name, cfg)
        whole = load_file(str(directory / WEIGHTS))
        set_peft_model_state_dict(
            self.peft, lora_shards.split(whole, self.shards, self.plan), adapter_name=name
        )
        for param in self._params_of(name).values():
            param.requires_grad_(False)


def _weightless_model(config: PretrainedConfig, base_model: str) -> torch.nn.Module:
    """The model of `config` with no weights: linear layers of the whole shapes over one
    shared zero (what PEFT reads to size and place LoRA), the rest on the meta device."""
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    zero = torch.zeros((), dtype=torch.float32)
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            shape = (module.out_features, module.in_features)
            module.weight = torch.nn.Parameter(zero.expand(shape), requires_grad=False)
            module.register_parameter("bias", None)  # PEFT reads no bias to size LoRA
    model.requires_grad_(False)
    model.name_or_path = base_model  # as load_frozen_base names the real one (PEFT records it)
    return model
