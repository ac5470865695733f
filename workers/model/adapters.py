"""Many LoRA adapters on one resident base model, each with its own AdamW and step count.

All adapters live in one PeftModel (PEFT's multi-adapter support); the one an op belongs to is
made active before it runs, which also makes its parameters the only trainable ones. Adapters
beyond `max_resident` are evicted least recently used first: the engine writes their state to
storage and deletes them here, and restores them on their next op.
"""

from __future__ import annotations

import hashlib
import re
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Set
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftConfig, PeftModel, get_peft_model
from peft.utils import set_peft_model_state_dict

from queue_tinker.types.requests.training import LORA_ALPHA, LORA_DROPOUT, LoraConfig
from queue_tinker.workers.model.checkpoints import AdapterState, CheckpointMeta
from queue_tinker.workers.model.families import Family, family_of
from queue_tinker.workers.model.lora.grouped_lora import LoraStacks
from queue_tinker.workers.model.lora.row_blocks import LoraLayer, lora_layers_of


def linear_names(model: torch.nn.Module) -> set[str]:
    """Short names of the model's linear layers (read before PEFT wraps them), those under
    its family's frozen modules left out (a vision tower: its names, qkv, proj, fc1, fc2,
    then match none of the language model's, so no LoRA lands there)."""
    frozen = set(family_of(getattr(model, "config", "")).frozen)
    return {
        name.rsplit(".", 1)[-1]
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and not frozen.intersection(name.split("."))
    }


def stacked_experts(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """(name, parameter) of each stacked experts' weight: a 3-D parameter, a matrix an expert,
    of a module that says how many experts it holds (transformers 5's fused experts:
    Qwen3-MoE, Mixtral, GPT-OSS). Other 3-D weights (a Conv1d's) are not experts."""
    found = []
    for prefix, module in model.named_modules():
        experts = getattr(module, "num_experts", None)
        if not isinstance(experts, int):
            continue
        for name, param in module.named_parameters(prefix=prefix, recurse=False):
            if param.ndim == 3 and param.shape[0] == experts:
                found.append((name, param))
    return found


def expert_parameters(model: torch.nn.Module) -> set[str]:
    """Stacked experts' weights as PEFT's `target_parameters` names them ("experts.down_proj"),
    read before PEFT wraps them."""
    return {".".join(name.rsplit(".", 2)[-2:]) for name, _ in stacked_experts(model)}


def target_modules(present: set[str], config: LoraConfig, family: Family) -> list[str]:
    """The linear-layer names that the LoRA config asks to adapt, of those the model has."""
    wanted: set[str] = set()
    if config.train_attn:
        wanted.update(family.attention)
    if config.train_mlp:
        wanted.update(family.mlp)
    if config.train_unembed:
        wanted.update(family.unembed)
    return sorted(wanted & present)


def target_parameters(experts: Set[str], config: LoraConfig, family: Family) -> list[str]:
    """The experts' stacked weights the LoRA config asks to adapt: all of them with the MLP
    (Tinker's train_mlp covers MoE layers) in a family that adapts experts, else none."""
    return sorted(experts) if config.train_mlp and family.experts else []


def peft_config(
    present: set[str],
    config: LoraConfig,
    base_model: str,
    family: Family,
    experts: Set[str] = frozenset(),
) -> PeftLoraConfig:
    return PeftLoraConfig(
        r=config.rank,
        lora_alpha=LORA_ALPHA,
        lora_dropout=LORA_DROPOUT,
        target_modules=target_modules(present, config, family),
        target_parameters=target_parameters(experts, config, family) or None,
        base_model_name_or_path=base_model,
        task_type="CAUSAL_LM",
    )


def local_grad_norm(params: Mapping[str, torch.nn.Parameter]) -> torch.Tensor:
    """The 2-norm of an adapter's gradients, all of them in this process."""
    return torch.nn.utils.get_total_norm([p.grad for p in params.values() if p.grad is not None])


@dataclass
class Adapter:
    """One model (training run) resident on this worker."""

    model_id: str
    name: str  # the PEFT adapter name
    tenant_id: str
    config: LoraConfig
    params: dict[str, torch.nn.Parameter]  # keyed by PEFT state-dict name
    optimizer: torch.optim.AdamW
    step: int = 0
    last_seq: int = 0
    snapshot_seq: int = 0  # newest seq whose state is on disk
    context_cap: int | None = None  # its base model name's :peft:<tokens> cap, if any
    extra: dict[str, Any] = field(default_factory=dict)
    # A sharded worker group's adapter sums its ranks' parts (lora_shards.grad_norm).
    grad_norm: Callable[[Mapping[str, torch.nn.Parameter]], torch.Tensor] = local_grad_norm

    def has_grads(self) -> bool:
        return any(p.grad is not None for p in self.params.values())


def new_optimizer(params: Iterable[torch.nn.Parameter]) -> torch.optim.AdamW:
    """torch's AdamW over the adapter's parameters; the multi-tensor (foreach) kernels, which
    torch picks by itself only on CUDA: on the CPU they take 30% less time over an adapter's
    small tensors than the loop over each, with the same results to the bit."""
    return torch.optim.AdamW(list(params), foreach=True)


def adapter_name(model_id: str) -> str:
    return "a_" + re.sub(r"[^A-Za-z0-9_]", "_", model_id)


@contextmanager
def peft_deprecation_quiet() -> Iterator[None]:
    """peft 0.21 asks transformers 5 a deprecated question when it adds an adapter; nothing
    for us to change."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=".*is_gradient_checkpointing.*deprecated", category=FutureWarning
        )
        yield


@contextmanager
def native_targets() -> Iterator[None]:
    """Meanwhile PEFT takes a LoRA config's targets as written. On its own it rewrites them
    for a mixture-of-experts model whose architecture transformers 5 changed, as though a
    transformers 4 checkpoint's names were meant (DeepSeek-V3, Qwen2-MoE and their kin:
    `gate_proj`, `up_proj`, `down_proj` become the experts' stacked weights), which leaves a
    dense layer's and a shared expert's MLP without LoRA (DeepSeek-V3's first 3 layers and
    every shared expert). Our configs and checkpoints name transformers 5's modules."""
    from peft.utils import transformers_weight_conversion as conversion

    rewrite = conversion.convert_peft_config_for_transformers
    conversion.convert_peft_config_for_transformers = _as_written
    try:
        yield
    finally:
        conversion.convert_peft_config_for_transformers = rewrite


def _as_written(peft_config: PeftConfig, model: torch.nn.Module, conversions: Any) -> None:
    """PEFT's config rewrite, made to leave the config as it is (native_targets)."""


class AdapterPool:
    """The base model plus its resident adapters, in least-recently-used order."""

    def __init__(self, base: torch.nn.Module, base_model: str, max_resident: int) -> None:
        self.base = base
        self.family = family_of(getattr(base, "config", ""))
        self.linear_names = linear_names(base)
        self.expert_parameters = expert_parameters(base)
        self.base_model = base_model
        self.max_resident = max_resident
        self.peft: PeftModel | None = None
        self.adapters: OrderedDict[str, Adapter] = OrderedDict()
        self.samplers: OrderedDict[Path, str] = OrderedDict()  # checkpoint dir -> adapter name
        self.active: str | None = None
        self._lora_layers: list[LoraLayer] | None = None
        # The dtype of LoRA's matmuls in passes (row_blocks); None: the adapters' own (fp32).
        self.lora_compute: torch.dtype | None = None
        # The adapters' LoRA weights stacked for grouped passes (their storage once stacked).
        self.lora_stacks = LoraStacks()

    @property
    def model(self) -> torch.nn.Module:
        return self.peft if self.peft is not None else self.base

    def get(self, model_id: str) -> Adapter | None:
        adapter = self.adapters.get(model_id)
        if adapter is not None:
            self.adapters.move_to_end(model_id)
        return adapter

    def over_capacity(self) -> list[Adapter]:
        """Adapters to evict (oldest first) to make room for one more."""
        excess = len(self.adapters) + 1 - self.max_resident
        return list(self.adapters.values())[: max(0, excess)]

    def add(self, model_id: str, tenant_id: str, config: LoraConfig, seed: int) -> Adapter:
        """A fresh adapter: LoRA A from `seed` (B is zero), new AdamW."""
        name = adapter_name(model_id)
        cfg = peft_config(
            self.linear_names, config, self.base_model, self.family, self.expert_parameters
        )
        torch.manual_seed(seed)  # PEFT initialises lora_A from the global generator
        self._attach(name, cfg)
        self.active = None
        self._lora_layers = None  # the new adapter may adapt layers no other one did
        params = self._params_of(name)
        adapter = Adapter(
            model_id=model_id,
            name=name,
            tenant_id=tenant_id,
            config=config,
            params=params,
            optimizer=new_optimizer(params.values()),
        )
        self.adapters[model_id] = adapter
        return adapter

    def activate(self, adapter: Adapter) -> None:
        assert self.peft is not None
        if self.active != adapter.name:
            self.peft.set_adapter(adapter.name)
            self.active = adapter.name

    def lora_layers(self) -> list[LoraLayer]:
        """The model's LoRA layers, linear and experts' (a traversal of every module, ~3 ms
        with 8 adapters on the tiny model: kept until an adapter comes or goes); none while no
        adapter is."""
        if self._lora_layers is None:
            self._lora_layers = [] if self.peft is None else lora_layers_of(self.peft)
        return self._lora_layers

    @contextmanager
    def shared(self, adapters: Iterable[Adapter], trainable: Set[str]) -> Iterator[None]:
        """For one pass whose rows each pick their adapter (cross-adapter batching): meanwhile
        the `trainable` adapters' parameters require grad and the other adapters' do not;
        afterwards they are as activate() left them."""
        adapters = list(adapters)
        if self.active is None:
            # PeftModel.forward reads the active adapter's config even when every row names
            # its adapter, and after a delete the adapter named active may be gone.
            self.activate(adapters[0])
        try:
            for adapter in adapters:
                for param in adapter.params.values():
                    param.requires_grad_(adapter.name in trainable)
            yield
        finally:
            for adapter in adapters:  # set_adapter's flags: only the active one trains
                for param in adapter.params.values():
                    param.requires_grad_(adapter.name == self.active)

    def remove(self, model_id: str) -> None:
        adapter = self.adapters.pop(model_id, None)
        if adapter is None or self.peft is None:
            return
        for p in adapter.params.values():
            p.grad = None
        self._delete(adapter.name)

    def sampler(self, directory: Path) -> str:
        """The adapter name of a checkpoint's weights, loaded frozen for sampling. Checkpoints
        are never overwritten, so a loaded one stays valid for as long as it is cached."""
        name = self.samplers.get(directory)
        if name is not None:
            self.samplers.move_to_end(directory)
            return name
        while len(self.samplers) >= self.max_resident:
            self._delete(self.samplers.popitem(last=False)[1])
        name = "s_" + hashlib.sha256(str(directory).encode()).hexdigest()[:16]
        self._load_frozen(directory, name)
        self.active = None  # loading may have moved PEFT's active adapter
        self._lora_layers = None
        self.samplers[directory] = name
        return name

    def _attach(self, name: str, cfg: PeftConfig) -> None:
        """Adapter `name`, from its config, onto the base model (the first makes the
        PeftModel)."""
        with peft_deprecation_quiet(), native_targets():
            if self.peft is None:
                self.peft = get_peft_model(self.base, cfg, adapter_name=name)
            else:
                self.peft.add_adapter(name, cfg)

    def _load_frozen(self, directory: Path, name: str) -> None:
        """PEFT files of `directory` as the frozen adapter `name`."""
        with native_targets():
            if self.peft is None:
                self.peft = PeftModel.from_pretrained(
                    self.base, str(directory), adapter_name=name, is_trainable=False
                )
            else:
                self.peft.load_adapter(str(directory), adapter_name=name, is_trainable=False)

    def _delete(self, name: str) -> None:
        assert self.peft is not None
        with warnings.catch_warnings():
            # PEFT warns that it moved the active adapter elsewhere; we re-activate per op.
            warnings.filterwarnings("ignore", message="Adapter .* was active which is now deleted")
            self.peft.delete_adapter(name)
        if not self.peft.peft_config:
            # The last adapter is gone, but PEFT still names it active, and every forward
            # reads the active adapter's config (KeyError: base-model samples failed until a
            # training op added an adapter). Unwrap: the base model takes its plain layers back
            # and the next adapter starts a new PeftModel.
            self.base = self.peft.unload()
            self.peft = None
        self.active = None
        self._lora_layers = None

    def peft_adapter_config(self, adapter: Adapter) -> dict[str, Any]:
        assert self.peft is not None
        config = self.peft.peft_config[adapter.name].to_dict()
        for key in ("target_modules", "target_parameters"):  # sets in PEFT (or None)
            if config.get(key) is not None:
                config[key] = sorted(config[key])
        return config

    # --- state in and out ------------------------------------------------------------------
    def export(self, adapter: Adapter, meta: CheckpointMeta) -> AdapterState:
        """A CPU copy of the adapter's weights, optimizer moments (AdamW's, or Dimuon's
        momentum) and pending gradients."""
        state = AdapterState(
            meta=meta, weights={k: p.detach().cpu().clone() for k, p in adapter.params.items()}
        )
        for key, p in adapter.params.items():
            moments = adapter.optimizer.state.get(p)
            if moments:
                state.exp_avg[key] = moments["exp_avg"].cpu().clone()
                if "exp_avg_sq" in moments:  # AdamW's; Dimuon keeps a momentum only
                    state.exp_avg_sq[key] = moments["exp_avg_sq"].cpu().clone()
                meta.optimizer_steps[key] = int(moments["step"])
            if p.grad is not None:
                state.grads[key] = p.grad.detach().cpu().clone()
        return state

    def load_weights(self, adapter: Adapter, weights: dict[str, torch.Tensor]) -> None:
        assert self.peft is not None
        missing = sorted(set(adapter.params) - set(weights))
        if missing:
            raise KeyError(f"checkpoint lacks {len(missing)} adapter tensors, e.g. {missing[0]}")
        result = set_peft_model_state_dict(self.peft, weights, adapter_name=adapter.name)
        unexpected = getattr(result, "unexpected_keys", None)
        if unexpected:
            raise KeyError(f"checkpoint has tensors this adapter lacks, e.g. {unexpected[0]}")

    def load_optimizer(self, adapter: Adapter, state: AdapterState) -> None:
        """Fresh AdamW, then the saved moments (none saved: moments start at zero)."""
        adapter.optimizer = new_optimizer(adapter.params.values())
        for key, p in adapter.params.items():
            if key in state.exp_avg:
                moments = {
                    "step": torch.tensor(float(state.meta.optimizer_steps.get(key, 0))),
                    "exp_avg": state.exp_avg[key].to(p.device, p.dtype),
                }
                if key in state.exp_avg_sq:  # AdamW's; Dimuon keeps a momentum only
                    moments["exp_avg_sq"] = state.exp_avg_sq[key].to(p.device, p.dtype)
                adapter.optimizer.state[p] = moments

    def load_grads(self, adapter: Adapter, grads: dict[str, torch.Tensor]) -> None:
        for key, p in adapter.params.items():
            p.grad = grads[key].to(p.device, p.dtype) if key in grads else None

    def _params_of(self, name: str) -> dict[str, torch.nn.Parameter]:
        assert self.peft is not None
        marker = f".{name}."
        return {
            n.replace(f".{name}", ""): p for n, p in self.peft.named_parameters() if marker in n
        }
