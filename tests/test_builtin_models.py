"""Built-in models: byte tokenizer, deterministic local weights, the real from_pretrained path."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from queue_tinker.builtin_models import (
    BOS_ID,
    BUILTIN_MODELS,
    EOS_ID,
    PAD_ID,
    VOCAB_SIZE,
    builtin_dir,
    ensure_tokenizer,
    is_builtin,
    load_tokenizer,
    publish_dir,
    staging_dir,
)

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from transformers import AutoTokenizer, LlamaForCausalLM  # noqa: E402

from queue_tinker.workers.model.base_model import (  # noqa: E402
    _model_of,
    builtin_config,
    context_length,
    ensure_builtin_model,
    load_base_model,
    resolve_model_path,
    vocab_size,
)

TINY = "queue-tinker/tiny-llama"
TINY_VL = "queue-tinker/tiny-vl"
MOE = "queue-tinker/tiny-moe"
FAMILY_BUILTINS = (
    "queue-tinker/tiny-qwen3",
    "queue-tinker/tiny-gpt-oss",
    "queue-tinker/tiny-deepseek-v3",
    "queue-tinker/tiny-qwen3.5",
    "queue-tinker/tiny-qwen3-vl",
)
TEXTS = ["A", "hello , world . isn 't", "héllo ✓", "日本語 🎉\n\t  x\x00\x7f", ""]


def test_catalogue_and_paths(tmp_path: Path) -> None:
    assert set(BUILTIN_MODELS) == {TINY, MOE, "queue-tinker/llama-100m", TINY_VL, *FAMILY_BUILTINS}
    assert is_builtin(TINY) and not is_builtin("meta-llama/Llama-3.2-1B")
    assert builtin_dir(TINY, tmp_path) == tmp_path / "queue-tinker--tiny-llama"
    assert resolve_model_path("some/hub-id", tmp_path) == "some/hub-id"
    assert not any(tmp_path.iterdir())  # a non-built-in name creates nothing


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_round_trip_is_bytes(tmp_path: Path, text: str) -> None:
    tok = load_tokenizer(TINY, tmp_path)
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))  # no BOS/EOS added by default
    assert tok.decode(ids) == text


def test_tokenizer_specials_and_autotokenizer(tmp_path: Path) -> None:
    directory = ensure_tokenizer(TINY, tmp_path)
    assert directory == builtin_dir(TINY, tmp_path)
    tok = AutoTokenizer.from_pretrained(str(directory))
    assert tok.is_fast
    assert len(tok) == VOCAB_SIZE
    assert (tok.bos_token, tok.bos_token_id) == ("<|bos|>", BOS_ID)
    assert (tok.eos_token, tok.eos_token_id) == ("<|eos|>", EOS_ID)
    assert (tok.pad_token, tok.pad_token_id) == ("<|pad|>", PAD_ID)
    assert tok.encode("A") == [65]
    assert tok.decode([BOS_ID, 65, EOS_ID]) == "<|bos|>A<|eos|>"
    assert tok.decode([BOS_ID, 65, EOS_ID, PAD_ID], skip_special_tokens=True) == "A"
    # Cached per (name, models_dir), and a second ensure leaves the files alone.
    assert load_tokenizer(TINY, tmp_path) is load_tokenizer(TINY, tmp_path)
    mtime = (directory / "tokenizer.json").stat().st_mtime_ns
    ensure_tokenizer(TINY, tmp_path)
    assert (directory / "tokenizer.json").stat().st_mtime_ns == mtime


def _tensors(directory: Path) -> dict[str, Any]:
    return safetensors_torch.load_file(str(directory / "model.safetensors"))


def test_ensure_builtin_model_idempotent_and_deterministic(tmp_path: Path) -> None:
    rng_before = torch.random.get_rng_state()
    first = ensure_builtin_model(TINY, tmp_path / "a")
    assert torch.equal(torch.random.get_rng_state(), rng_before)  # caller's RNG untouched
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    assert ensure_builtin_model(TINY, tmp_path / "a") == first
    assert (first / "model.safetensors").stat().st_mtime_ns == mtime
    assert not [p.name for p in first.parent.iterdir() if p.name.startswith(".")]  # no staging

    second = ensure_builtin_model(TINY, tmp_path / "b")
    a, b = _tensors(first), _tensors(second)
    assert a.keys() == b.keys() and a
    for key in a:
        assert a[key].dtype == torch.float32
        assert torch.equal(a[key], b[key]), key


def test_model_added_to_tokenizer_only_dir(tmp_path: Path) -> None:
    directory = ensure_tokenizer(TINY, tmp_path)
    assert ensure_builtin_model(TINY, tmp_path) == directory
    tok = AutoTokenizer.from_pretrained(str(directory))  # still reads with config.json beside it
    assert tok.decode(tok.encode("héllo ✓")) == "héllo ✓"
    assert tok.pad_token_id == PAD_ID


def test_load_base_model_forward(tmp_path: Path) -> None:
    model = load_base_model(TINY, "cpu", tmp_path)
    assert isinstance(model, LlamaForCausalLM)
    params = list(model.parameters())
    assert params and all(p.dtype == torch.float32 and not p.requires_grad for p in params)
    assert vocab_size(model) == VOCAB_SIZE
    assert context_length(model) == 256
    tok = load_tokenizer(TINY, tmp_path)
    ids = torch.tensor([[BOS_ID, *tok.encode("hello")]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], VOCAB_SIZE)
    assert torch.isfinite(logits).all()


def test_llama_100m_param_count_without_weights() -> None:
    with torch.device("meta"):
        model = LlamaForCausalLM(builtin_config("queue-tinker/llama-100m"))
    count = sum(p.numel() for p in model.parameters())
    assert 80_000_000 <= count <= 130_000_000
    assert f"{count:,}" in BUILTIN_MODELS["queue-tinker/llama-100m"].description


def test_tiny_param_count_matches_description() -> None:
    with torch.device("meta"):
        model = LlamaForCausalLM(builtin_config(TINY))
    count = sum(p.numel() for p in model.parameters())
    assert f"{count:,}" in BUILTIN_MODELS[TINY].description


def test_concurrent_ensure_builtin_model(tmp_path: Path) -> None:
    results: list[Path] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def build() -> None:
        try:
            barrier.wait()
            results.append(ensure_builtin_model(TINY, tmp_path))
        except BaseException as exc:  # surfaced below; a thread can't fail the test itself
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert results == [builtin_dir(TINY, tmp_path)] * 2
    assert [p.name for p in tmp_path.iterdir()] == ["queue-tinker--tiny-llama"]  # no staging
    model = load_base_model(TINY, "cpu", tmp_path)
    assert vocab_size(model) == VOCAB_SIZE


def test_publish_keeps_the_winners_files(tmp_path: Path) -> None:
    final = tmp_path / "m"
    final.mkdir()
    (final / "config.json").write_text("theirs")
    staging = staging_dir(final)
    (staging / "config.json").write_text("ours")
    (staging / "model.safetensors").write_text("ours")
    publish_dir(staging, final)
    assert (final / "config.json").read_text() == "theirs"
    assert (final / "model.safetensors").read_text() == "ours"  # missing pieces are added
    assert [p.name for p in tmp_path.iterdir()] == ["m"]


def test_tiny_vl_loads_through_from_pretrained_with_its_image_processor(tmp_path: Path) -> None:
    """queue-tinker/tiny-vl: a Qwen2-VL made locally with the parameter count its description
    says, its tokenizer the bytes plus the vision tokens, its image processor saved beside it;
    the model loads through AutoModelForImageTextToText and the processor through
    AutoImageProcessor, both from the directory."""
    from transformers import AutoImageProcessor, Qwen2VLForConditionalGeneration

    from queue_tinker.builtin_models import IMAGE_PAD_ID, VL_VOCAB_SIZE

    model = load_base_model(TINY_VL, "cpu", tmp_path)
    assert isinstance(model, Qwen2VLForConditionalGeneration)
    count = sum(p.numel() for p in model.parameters())
    assert f"{count:,}" in BUILTIN_MODELS[TINY_VL].description
    assert vocab_size(model) == VL_VOCAB_SIZE and context_length(model) == 512
    path = builtin_dir(TINY_VL, tmp_path)
    processor = AutoImageProcessor.from_pretrained(str(path), backend="pil")
    assert (processor.patch_size, processor.merge_size) == (4, 2)
    tok = load_tokenizer(TINY_VL, tmp_path)
    assert tok.convert_tokens_to_ids("<|image_pad|>") == IMAGE_PAD_ID == model.config.image_token_id
    assert tok.encode("hi") == [104, 105]


def test_tiny_moe_is_a_qwen3_moe_with_tiny_llamas_active_size(tmp_path: Path) -> None:
    """tiny-moe: Qwen3-MoE from its catalogue entry's model_type; 4 experts of which 2 run a
    token, so the parameters a token uses are within 1% of tiny-llama's (the router and the
    q/k norms are the difference)."""
    assert builtin_config(TINY).model_type == "llama"
    model = load_base_model(MOE, "cpu", tmp_path)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for p in model.parameters() if p.ndim == 3)
    assert (total, experts) == (156_928, 98_304)
    active = total - experts // 2  # top 2 of 4
    assert active == 107_776 and abs(active - 107_200) / 107_200 < 0.01
    tok = load_tokenizer(MOE, tmp_path)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tok.encode("hello")])).logits
    assert logits.shape == (1, 5, VOCAB_SIZE) and torch.isfinite(logits).all()


@pytest.mark.parametrize("name", FAMILY_BUILTINS)
def test_family_builtins_are_their_architecture_with_the_count_described(name: str) -> None:
    """Each family's tiny built-in is a model of that family's transformers class (its
    model_type's), with the parameter count its description names."""
    spec = BUILTIN_MODELS[name]
    config = builtin_config(name)
    assert config.model_type == spec.model_type
    with torch.device("meta"):
        model = _model_of(config)
    assert model.config.model_type == spec.model_type
    count = sum(p.numel() for p in model.parameters())
    assert f"{count:,}" in spec.description
