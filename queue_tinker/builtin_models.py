"""Built-in tiny models: made locally (fixed-seed random init, byte-level tokenizer), no Hub needed.

Each built-in model lives under `models_dir` as an ordinary Hugging Face directory, so everything
downstream (tests, demo, benchmarks, workers) loads it through the real `from_pretrained(path)`
path. This module holds the catalogue and the tokenizer; it must not import torch (the gateway
and client use it). The weights are made by
`queue_tinker.workers.model.base_model.ensure_builtin_model`.

The tokenizer: ids 0..255 are the raw byte values, then `<|bos|>`=256, `<|eos|>`=257,
`<|pad|>`=258. `encode(text)` adds NO special tokens, so it gives exactly `text.encode("utf-8")`
as ids and `decode(encode(text)) == text` for any text. As with every HF tokenizer, the literal
strings `<|bos|>`/`<|eos|>`/`<|pad|>` inside text are read as the special tokens.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from queue_tinker.extras import missing_extra

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
PAD_TOKEN = "<|pad|>"
BOS_ID = 256
EOS_ID = 257
PAD_ID = 258
VOCAB_SIZE = 259  # 256 bytes + 3 specials

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
MODEL_FILES = ("model.safetensors", "config.json")
# Moved into place last, so a directory that has them has everything they describe.
_LAST_FILES = ("tokenizer_config.json", "config.json")


# A vision-language built-in's tokens after the byte tokenizer's: Qwen2-VL's names.
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
VISION_START_ID, VISION_END_ID, IMAGE_PAD_ID, VIDEO_PAD_ID = range(VOCAB_SIZE, VOCAB_SIZE + 4)
VL_VOCAB_SIZE = VOCAB_SIZE + len(VISION_TOKENS)
IMAGE_PROCESSOR_FILES = ("preprocessor_config.json",)


@dataclass(frozen=True)
class BuiltinModel:
    name: str
    description: str
    # Kwargs of the config class of `model_type` (token ids added at build); a
    # vision-language model's are its text model's.
    config: dict[str, Any] = field(hash=False)
    model_type: str = "llama"  # transformers' name for the architecture (config.json's)
    # A vision-language model (Qwen2-VL): its vision tower's config and its image processor's
    # settings. None: a text-only model.
    vision: dict[str, Any] | None = field(default=None, hash=False)
    image_processor: dict[str, Any] | None = field(default=None, hash=False)

    @property
    def special_tokens(self) -> tuple[str, ...]:
        """The tokenizer's special tokens after the bytes, in id order."""
        base = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)
        return (*base, *VISION_TOKENS) if self.vision is not None else base


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    m.name: m
    for m in (
        BuiltinModel(
            name="queue-tinker/tiny-llama",
            description="Llama, 2 layers, hidden 64, byte tokenizer; 107,200 params (tests).",
            config={
                "vocab_size": VOCAB_SIZE,
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "max_position_embeddings": 256,
                "tie_word_embeddings": False,
                "rms_norm_eps": 1e-5,
            },
        ),
        BuiltinModel(
            name="queue-tinker/llama-100m",
            description=(
                "Llama, 16 layers, hidden 768, byte tokenizer; 101,086,464 params (benchmarks)."
            ),
            config={
                "vocab_size": VOCAB_SIZE,
                "hidden_size": 768,
                "intermediate_size": 2048,
                "num_hidden_layers": 16,
                "num_attention_heads": 12,
                "num_key_value_heads": 4,
                "max_position_embeddings": 1024,
                "tie_word_embeddings": False,
                "rms_norm_eps": 1e-5,
            },
        ),
        BuiltinModel(
            name="queue-tinker/tiny-vl",
            description=(
                "Qwen2-VL, 2 text layers (hidden 64) and a 1-block vision tower over 4x4 "
                "patches, byte tokenizer + vision tokens; images of 8x8 to 64x64 pixels after "
                "resizing, 1 token per 8x8 pixels; 144,416 params (tests)."
            ),
            model_type="qwen2_vl",
            config={
                "vocab_size": VL_VOCAB_SIZE,
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "max_position_embeddings": 512,
                "tie_word_embeddings": False,
                "rms_norm_eps": 1e-5,
                # head_dim 16: its 8 rotary frequencies split over time, height and width.
                "rope_parameters": {
                    "rope_type": "default",
                    "rope_theta": 10000.0,
                    "mrope_section": [2, 3, 3],
                },
            },
            vision={
                "depth": 1,
                "embed_dim": 32,
                "hidden_size": 64,
                "num_heads": 2,
                "mlp_ratio": 2,
                "patch_size": 4,
                "spatial_merge_size": 2,
                "temporal_patch_size": 2,
                "in_channels": 3,
            },
            image_processor={
                "patch_size": 4,
                "merge_size": 2,
                "temporal_patch_size": 2,
                "min_pixels": 8 * 8,
                "max_pixels": 64 * 64,
            },
        ),
        BuiltinModel(
            name="queue-tinker/tiny-qwen3-vl",
            description=(
                "Qwen3-VL, 2 text layers (hidden 64) and a 2-block vision tower over 4x4 "
                "patches (the first block's features deepstacked), byte tokenizer + vision "
                "tokens; images as tiny-vl's; 178,336 params (tests)."
            ),
            model_type="qwen3_vl",
            config={
                "vocab_size": VL_VOCAB_SIZE,
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 16,
                "max_position_embeddings": 512,
                "rms_norm_eps": 1e-5,
                "rope_parameters": {
                    "rope_type": "default",
                    "rope_theta": 10000.0,
                    "mrope_section": [2, 3, 3],
                    "mrope_interleaved": True,
                },
            },
            vision={
                "depth": 2,
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_heads": 2,
                "patch_size": 4,
                "spatial_merge_size": 2,
                "temporal_patch_size": 2,
                "in_channels": 3,
                "out_hidden_size": 64,
                "num_position_embeddings": 16,
                "deepstack_visual_indexes": [0],
            },
            image_processor={
                "patch_size": 4,
                "merge_size": 2,
                "temporal_patch_size": 2,
                "min_pixels": 8 * 8,
                "max_pixels": 64 * 64,
            },
        ),
        BuiltinModel(
            name="queue-tinker/tiny-moe",
            description=(
                "Qwen3-MoE, 2 layers, hidden 64, 4 experts (top 2), byte tokenizer; 156,928 "
                "params, 107,776 active a token (tests)."
            ),
            model_type="qwen3_moe",
            config={
                "vocab_size": VOCAB_SIZE,
                "hidden_size": 64,
                # Two experts of 64 a token: the active MLP is tiny-llama's (128 wide).
                "moe_intermediate_size": 64,
                "intermediate_size": 128,
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "norm_topk_prob": True,  # as Qwen3-30B-A3B
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 16,
                "max_position_embeddings": 256,
                "tie_word_embeddings": False,
                "rms_norm_eps": 1e-5,
            },
        ),
        BuiltinModel(
            name="queue-tinker/tiny-qwen3",
            description="Qwen3, 2 layers, hidden 64, byte tokenizer; 107,264 params (tests).",
            model_type="qwen3",
            config={
                "vocab_size": VOCAB_SIZE,
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 16,
                "max_position_embeddings": 256,
                "tie_word_embeddings": False,
                "rms_norm_eps": 1e-5,
            },
        ),
        BuiltinModel(
            name="queue-tinker/tiny-gpt-oss",
            description=(
                "gpt-oss, 2 layers (a sliding window of 8, then full attention, both with "
                "sinks), hidden 64, 4 experts (top 2), byte tokenizer; 158,800 params (tests)."
            ),
            model_type="gpt_oss",
            config={
                "vocab_size": VOCAB_SIZE,
                "hidden_size": 64,
                "intermediate_size": 64,
                "num_local_experts": 4,
                "num_experts_per_tok": 2,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 16,
                "sliding_window": 8,
                "layer_types": ["sliding_attention", "full_attention"],
                "max_position_embeddings": 256,
                # YaRN as gpt-oss's, its factor that of this context over the original's.
                "rope_parameters": {
                    "rope_type": "yarn",
                    "rope_theta": 150000.0,
                    "factor": 2.0,
                    "original_max_position_embeddings": 128,
                    "beta_fast": 32.0,
                    "beta_slow": 1.0,
                },
                "tie_word_embeddings": False,
                "rms_norm_eps": 1e-5,
            },
        ),
        BuiltinModel(
            name="queue-tinker/tiny-deepseek-v3",
            description=(
                "DeepSeek-V3 (Kimi-K2's architecture), 2 layers (a dense one, then 1 shared + "
                "4 routed experts, top 2), latent attention, hidden 64, byte tokenizer; "
                "109,584 params (tests)."
            ),
            model_type="deepseek_v3",
            config={
                "vocab_size": VOCAB_SIZE,
                "hidden_size": 64,
                "intermediate_size": 128,
                "moe_intermediate_size": 32,
                "num_hidden_layers": 2,
                "first_k_dense_replace": 1,
                "num_attention_heads": 4,
                "num_key_value_heads": 4,
                "n_shared_experts": 1,
                "n_routed_experts": 4,
                "num_experts_per_tok": 2,
                "n_group": 1,
                "topk_group": 1,
                "kv_lora_rank": 16,
                "q_lora_rank": 24,
                "qk_rope_head_dim": 8,
                "qk_nope_head_dim": 8,
                "v_head_dim": 16,
                "max_position_embeddings": 256,
                "tie_word_embeddings": False,
                "rms_norm_eps": 1e-5,
            },
        ),
        BuiltinModel(
            name="queue-tinker/tiny-qwen3.5",
            description=(
                "Qwen3.5, 4 layers (3 of linear attention, then 1 of full), hidden 64, byte "
                "tokenizer; 200,744 params (tests)."
            ),
            model_type="qwen3_5_text",
            config={
                "vocab_size": VOCAB_SIZE,
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 4,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 16,
                "linear_conv_kernel_dim": 4,
                "linear_key_head_dim": 16,
                "linear_value_head_dim": 16,
                "linear_num_key_heads": 2,
                "linear_num_value_heads": 4,
                "max_position_embeddings": 256,
                "tie_word_embeddings": False,
                "rms_norm_eps": 1e-5,
            },
        ),
    )
}


def is_builtin(name: str) -> bool:
    return name in BUILTIN_MODELS


def text_only(name: str) -> bool:
    """Whether `name` is a built-in model known to take no image (any other model's worker
    knows; the client and gateway cannot tell without loading its config)."""
    spec = BUILTIN_MODELS.get(name)
    return spec is not None and spec.vision is None


def builtin_dir(name: str, models_dir: Path) -> Path:
    # One flat directory per model; "/" would nest and clash with other names' prefixes.
    return Path(models_dir) / name.replace("/", "--")


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, the alphabet of the ByteLevel pre-tokenizer."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def write_tokenizer(
    path: Path, specials: tuple[str, ...] = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)
) -> None:
    """Write the byte-level tokenizer (tokenizer.json + tokenizer_config.json) into `path`,
    with `specials` after the 256 bytes (a vision-language model's: BuiltinModel.special_tokens)."""
    try:  # lazily: the light client installs no tokenizers
        from tokenizers import Tokenizer, decoders, models
        from tokenizers.pre_tokenizers import ByteLevel
    except ModuleNotFoundError as exc:
        raise missing_extra(exc, "the built-in model's tokenizer") from exc

    # A BPE with the 256 byte symbols and no merges: every byte is one token whose id is the
    # byte value. ByteLevel maps bytes to printable symbols and its decoder maps them back.
    vocab = {symbol: byte for byte, symbol in _byte_to_unicode().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(specials))  # ids 256, 257, 258, ...
    if (
        tokenizer.get_vocab_size() != 256 + len(specials)
        or tokenizer.token_to_id(PAD_TOKEN) != PAD_ID
    ):
        raise RuntimeError("byte tokenizer came out with unexpected ids")

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path / "tokenizer.json"))
    config = {
        # Written by hand (not save_pretrained) so both transformers 4.x and 5.x read it.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "add_bos_token": False,
        "add_eos_token": False,
        # Cleanup would turn " ." into "." and break the exact round trip.
        "clean_up_tokenization_spaces": False,
        # A plain role-prefixed template, so chat requests (the OpenAI-compatible
        # /chat/completions) work on the built-in models as on a Hub model with its own.
        "chat_template": CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def has_files(directory: Path, names: Iterable[str]) -> bool:
    return all((directory / n).is_file() for n in names)


def staging_dir(final: Path) -> Path:
    """A fresh private directory beside `final` (same filesystem, so renames are atomic)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))


def publish_dir(staging: Path, final: Path) -> None:
    """Move what was built in `staging` to `final` without readers ever seeing half of it.

    If `final` does not exist the whole directory is renamed in one step. If it exists (a
    concurrent builder won, or it holds only the tokenizer and we add weights) each missing file
    is moved in by an atomic rename, config files last, and files already there are kept.
    """
    try:
        os.rename(staging, final)
        return
    except OSError:
        if not final.is_dir():
            raise
    staged = sorted(staging.iterdir(), key=lambda p: p.name in _LAST_FILES)
    for src in staged:
        dest = final / src.name
        if not dest.exists():
            os.replace(src, dest)
    shutil.rmtree(staging, ignore_errors=True)


def ensure_tokenizer(name: str, models_dir: Path) -> Path:
    """Make sure the built-in model's directory has its tokenizer files; return the directory."""
    if not is_builtin(name):
        raise ValueError(f"not a built-in model: {name!r}")
    final = builtin_dir(name, models_dir)
    if has_files(final, TOKENIZER_FILES):
        return final
    staging = staging_dir(final)
    try:
        write_tokenizer(staging, BUILTIN_MODELS[name].special_tokens)
        publish_dir(staging, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # left over only if publishing failed
    return final


# Tokenizers loaded so far, by (base model, models_dir); filled under _TOKENIZER_LOCK.
_tokenizers: dict[tuple[str, Path], Any] = {}
# The first load of a tokenizer runs transformers' lazy imports, which race when threads
# start them at once: 5 of 16 concurrent first requests to a fresh gateway failed with
# "cannot import name 'AutoTokenizer' from 'transformers'". One lock around every first load.
_TOKENIZER_LOCK = threading.Lock()


def load_tokenizer(base_model: str, models_dir: Path) -> Any:
    """The tokenizer for `base_model`: a built-in name, a Hub id or a local path (cached).
    Safe from any number of threads at once: each tokenizer is loaded once, under a lock."""
    key = (base_model, models_dir)
    tokenizer = _tokenizers.get(key)
    if tokenizer is None:
        with _TOKENIZER_LOCK:
            tokenizer = _tokenizers.get(key)
            if tokenizer is None:
                tokenizer = _tokenizers[key] = _load_tokenizer(base_model, models_dir)
    return tokenizer


def _load_tokenizer(base_model: str, models_dir: Path) -> Any:
    try:  # lazily: transformers is ~1 s to import and the light client installs none
        from transformers import AutoTokenizer
    except ModuleNotFoundError as exc:
        raise missing_extra(exc, "get_tokenizer()") from exc

    if is_builtin(base_model):
        return AutoTokenizer.from_pretrained(str(ensure_tokenizer(base_model, models_dir)))
    return AutoTokenizer.from_pretrained(base_model)
