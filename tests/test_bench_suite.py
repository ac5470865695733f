"""The benchmark suite's command line and bench.mfu's parameter and FLOPs counts (no benchmark
runs here: they take minutes; `python -m bench --quick` is their smoke run)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest
import torch

from bench import sample_cache, sampling_engine, small_op, suite
from bench.decode_step import floor_ms
from bench.harness.models import BASE_NAME, Shape, build_model, lora_pool
from bench.harness.report import Table
from bench.harness.run import Run
from bench.harness.stats import Latency, LatencyResult, Stages
from bench.mfu import SHAPES, flops_per_token, lora_params, matmul_params, peak_tflops, total_params
from queue_tinker.storage.local import LocalStore
from queue_tinker.types.requests.training import LoraConfig
from queue_tinker.workers.model.adapters import AdapterPool, target_modules

if TYPE_CHECKING:
    import object_store

TINY = Shape(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=96, vocab=300)


def test_default_set_leaves_out_soak_and_only_picks_in_order() -> None:
    """No --only: every benchmark but the soak; --only: the named ones, in suite order."""
    assert [b.name for b in suite.chosen(suite.parse_args([]))] == [
        "queue",
        "train_step",
        "train_throughput",
        "sampling",
        "sampling_engine",
        "sample_cache",
        "prefix_cache",
        "gateway",
        "small_op",
        "big_bodies",
        "moe",
        "checkpoints",
        "mfu",
    ]
    args = suite.parse_args(["--quick", "--only", "mfu", "soak", "queue"])
    assert args.quick
    assert [b.name for b in suite.chosen(args)] == ["queue", "mfu", "soak"]


def test_unknown_benchmark_name_is_refused() -> None:
    with pytest.raises(SystemExit):
        suite.parse_args(["--only", "nope"])


def test_commands_fill_in_the_data_dir_and_skip_mfu_without_a_gpu() -> None:
    """A full mfu run needs CUDA (None without); its quick run smoke-tests on the CPU."""
    benches = {b.name: b for b in suite.BENCHES}
    data = Path("/tmp/data")
    argv = suite.command(benches["train_step"], False, data, cuda=False)
    assert argv is not None and argv[1:] == ["-m", "bench.train_step", "--data-dir", "/tmp/data"]
    assert suite.command(benches["mfu"], False, data, cuda=False) is None
    assert suite.command(benches["mfu"], True, data, cuda=False) is not None
    assert suite.command(benches["mfu"], False, data, cuda=True) is not None


def test_header_replaces_only_what_comes_before_the_first_section(tmp_path: Path) -> None:
    docs = tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n\nold head\n\n## A\n\nkept\n")
    suite.write_header(docs, "# Benchmarks\n\nnew head\n")
    assert docs.read_text() == "# Benchmarks\n\nnew head\n\n## A\n\nkept\n"


def test_moe_bench_counts_active_parameters_by_the_experts_a_token_runs() -> None:
    """bench.moe's active count: the dense model's all, the MoE's experts at top-2 of 4."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from bench.moe import active_params

    small = {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 10}
    with torch.device("meta"):
        dense = LlamaForCausalLM(LlamaConfig(intermediate_size=32, **small))
        moe = Qwen3MoeForCausalLM(
            Qwen3MoeConfig(moe_intermediate_size=8, num_experts=4, num_experts_per_tok=2, **small)
        )
    assert active_params(dense) == sum(p.numel() for p in dense.parameters())
    experts = 4 * (2 * 8 * 16 + 16 * 8)
    assert active_params(moe) == sum(p.numel() for p in moe.parameters()) - experts // 2


def test_llama_3_1_8b_counts() -> None:
    """Llama-3.1-8B has 8,030,261,248 parameters; the LoRA FLOPs per token at rank 32 on every
    linear, 2048 tokens: 4·N_mm + 6·N_lora + 12·L·d·T, worked out by hand."""
    shape = SHAPES["llama-3.1-8b"]
    assert total_params(shape) == 8_030_261_248
    assert matmul_params(shape) == 8_030_261_248 - 128_256 * 4096 - 65 * 4096
    n_lora = lora_params(shape, 32, list(shape.linears()))
    assert n_lora == 32 * 2_621_440 + 32 * (4096 + 128_256)
    flops = flops_per_token(shape, 2048, n_lora)
    assert flops["lora"] == 4 * 7_504_658_432 + 6 * 88_121_344 + 12 * 32 * 4096 * 2048
    assert flops["6N"] == 6 * 8_030_261_248


def test_counts_match_the_built_model_and_its_adapter() -> None:
    """The formulas' parameter counts against the model built from the config and a LoRA added
    through the worker's AdapterPool."""
    model = build_model(TINY, "cpu", torch.float32)
    assert sum(p.numel() for p in model.parameters()) == total_params(TINY)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert sum(m.weight.numel() for m in linears) == matmul_params(TINY)
    pool = AdapterPool(model, BASE_NAME, max_resident=2)
    config = LoraConfig(rank=8)
    adapter = pool.add("m", "t", config, seed=0)
    targets = target_modules(pool.linear_names, config, pool.family)
    assert sum(p.numel() for p in adapter.params.values()) == lora_params(TINY, 8, targets)


def test_the_decode_floor_reads_every_linear_and_the_rows_keys_and_values() -> None:
    """bench.decode_step's floor: the linears' weights (lm_head in, the embedding out), LoRA's
    bytes and rows x context tokens of keys and values, over the copy rate."""
    model = build_model(TINY, "cpu", torch.float32)
    linear_bytes = 4 * matmul_params(TINY)
    kv_bytes = 3 * 10 * TINY.layers * 2 * TINY.kv_heads * TINY.head_dim * 4
    rate = 1e6  # bytes/s: the floor in ms is bytes / 1e3
    want = (linear_bytes + 100 + kv_bytes) / rate * 1e3
    assert floor_ms(model, TINY, 3, 10, 100, rate) == pytest.approx(want)


def test_peak_table() -> None:
    assert peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert peak_tflops("NVIDIA H200") == 989.0
    assert peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert peak_tflops("NVIDIA GeForce RTX 4090") is None


def test_sampling_engine_ratios_are_service_over_same_run_baseline() -> None:
    """Each row of the sampling-engine table divides the service's figure by the baseline
    measured in the same run (medians over rounds; p90 for the training steps)."""
    size = sampling_engine.Size("m", tokens=8, fair_rows=4, fair_tokens=2, rounds=3)
    result = sampling_engine.Result(
        size,
        params=1_000_000,
        alone_s=[0.1, 0.2, 0.3],
        staggered_median_s=[0.3, 0.4, 0.5],
        staggered_tok_s=[10, 20, 30],
        generate_staggered_tok_s=[40, 40, 40],
        simultaneous_tok_s=[60, 60, 60],
        generate_simultaneous_tok_s=[50, 50, 50],
        long_samples_tok_s=[70, 90, 80],
        generate_long_samples_tok_s=[40, 40, 40],
        shared_tok_s=[30, 30, 30],
        separate_tok_s=[20, 20, 20],
        long_shared_tok_s=[40, 40, 40],
        long_distinct_tok_s=[10, 10, 10],
        step_alone_s=[0.01] * 10,
        step_under_s=[0.02] * 9 + [0.2],
        sample_alone_s=2.0,
        sample_shared_s=3.0,
    )
    ratios = [round(ratio, 3) for *_, ratio, _ in sampling_engine.rows(result)]
    p90_under = float(np.percentile([0.02] * 9 + [0.2], 90))
    assert ratios == [2.0, 0.5, 1.2, 2.0, 1.5, 4.0, round(p90_under / 0.01, 3), 1.5]
    assert len(sampling_engine.table([result]).lines()) == 2 + 8 + 1
    # A GPU run writes a section of its own and leaves the CPU section's text alone.
    cpu = sampling_engine.report({"CPU": "x"}, [result], 1.0, 2, "cpu")
    gpu = sampling_engine.report({"GPU": "y"}, [result], 1.0, 2, "cuda")
    assert cpu.heading == sampling_engine.SECTION
    assert gpu.heading == sampling_engine.GPU_SECTION
    assert "--device cuda" in gpu.command and "--device cuda" not in cpu.markdown()


def test_with_services_hands_the_command_urls_and_its_exit_code(redis_url: str) -> None:
    """bench.with_services: the URLs the caller set pass through unchanged (otherwise the
    default ones that answer, or embedded servers), and the command's exit code is its own."""
    code = (
        "import os, sys; print(os.environ['QT_BENCH_REDIS_URL'], "
        "os.environ['QT_BENCH_DATABASE_URL']); sys.exit(3)"
    )
    env = {**os.environ, "QT_BENCH_REDIS_URL": redis_url, "QT_BENCH_DATABASE_URL": "postgresql://x"}
    done = subprocess.run(
        [sys.executable, "-m", "bench.with_services", "--", sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert done.returncode == 3, done.stderr
    assert done.stdout.splitlines()[-1] == f"{redis_url} postgresql://x"


def test_sample_cache_rows_compare_each_case_with_the_unbudgeted_one() -> None:
    """The table gives each budget's measured cache in tokens and MiB, and how many of its
    samples equal the case without a budget."""
    cases = [
        sample_cache.Case(4, 128, None, 5.0, 641.2, 632, 4, 32768, ["a", "b", "c", "d"]),
        sample_cache.Case(4, 128, 320, 2.8, 627.0, 316, 2, 32768, ["a", "b", "x", "d"]),
    ]
    report = sample_cache.report(cases, {"torch": "t", "transformers": "x", "date": "d"})
    assert report.heading == sample_cache.SECTION
    text = report.markdown()
    assert "| none | 632 tokens (20 MiB) | 4 | 641 MiB | 5.0 s | 4 of 4 |" in text
    assert "| 320 | 316 tokens (10 MiB) | 2 | 627 MiB | 2.8 s | 3 of 4 |" in text


def test_mfu_s_plain_baseline_computes_the_engine_s_gradients() -> None:
    """bench.mfu holds the engine to plain transformers + PEFT on the same model, adapter and
    data: that baseline, with and without transformers' own checkpointing, gives the adapter
    the gradients the engine's pass gives (same loss: cross-entropy summed over the targets)."""
    from bench.harness import engine
    from bench.harness.baselines import plain_forward_backward
    from bench.harness.models import add_adapters, lora_pool
    from bench.mfu import random_data

    shape = SHAPES["small"]
    pool = lora_pool(build_model(shape, "cpu", torch.float32), BASE_NAME, adapters=2)
    [adapter] = add_adapters(pool, LoraConfig(rank=8), seeds=[0])
    with torch.no_grad():  # B starts at zero: give every LoRA matrix a gradient
        for key, param in adapter.params.items():
            if "lora_B" in key:
                param.normal_(std=0.02)
    data = random_data(shape, 3, 24)
    cpu = torch.device("cpu")

    def grads(run: Callable[[], object]) -> dict[str, torch.Tensor]:
        engine.clear_grads([adapter])
        run()
        return {k: p.grad.clone() for k, p in adapter.params.items() if p.grad is not None}

    want = grads(lambda: engine.forward_backward(pool, [(adapter, data)], cpu))
    for checkpointing in (False, True):
        got = grads(
            lambda c=checkpointing: plain_forward_backward(
                pool, adapter, data, cpu, checkpointing=c
            )
        )
        assert got.keys() == want.keys() and want
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=1e-4, atol=1e-6)


def test_checkpoint_bench_times_the_worker_s_writes_and_reads_in_both_stores(
    s3_server: object_store.S3Server, tmp_path: Path
) -> None:
    """bench.checkpoint_storage on a tiny random model: each kind is written and read back
    through a directory and a bucket, the same bytes in both, and the table has a row each."""
    from bench import checkpoint_storage as bench

    pool = lora_pool(build_model(TINY, "cpu", torch.float32), BASE_NAME, adapters=1)
    adapter = pool.add("m", "t", LoraConfig(rank=8), seed=0)
    for param in adapter.params.values():
        param.grad = torch.ones_like(param)
    adapter.optimizer.step()
    bucket = s3_server.bucket()
    stores = {
        "local": lambda _cache: LocalStore(tmp_path / "disk"),
        "s3": lambda cache: s3_server.store(bucket, cache),
    }
    results = [
        bench.measure(pool, adapter, kind, name, open_store, tmp_path, repeats=2)
        for kind in bench.KINDS
        for name, open_store in stores.items()
    ]
    sizes = [m.bytes for m in results]
    assert sizes[0::2] == sizes[1::2] and sizes[0] < sizes[2] < sizes[4]
    assert all(len(m.save_s) == len(m.load_s) == 2 for m in results)
    report = bench.report(results, "tiny", 2, 1000, {})
    text = report.markdown()
    assert report.heading == bench.SECTION and text.count("\n| ") == 2 + len(bench.KINDS)


def test_llama_3_2_1b_counts_and_its_own_docs_section() -> None:
    """Llama-3.2-1B has 1,235,814,400 parameters with its unembedding tied to the embedding;
    the bench's shape keeps them apart (the same FLOPs), one 128,256 x 2,048 matrix more. Its
    run writes a section of its own, never over the 8B headline's."""
    from bench.mfu import SECTION, section

    assert total_params(SHAPES["llama-3.2-1b"]) == 1_235_814_400 + 128_256 * 2048
    assert section("llama-3.1-8b") == SECTION
    assert section("llama-3.2-1b").startswith(SECTION) and section("llama-3.2-1b") != SECTION
    assert section("llama-3.2-1b") + "\n" not in SECTION + "\n"


def test_a_benchmark_names_the_commit_it_measured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run stamps the short HEAD, "+changes" where tracked files differ from it (a tree
    copied onto a lent machine with older git metadata), or the commit BENCH_COMMIT names."""
    from bench.harness import machine

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()

    git("init", "-q")
    (tmp_path / "a.txt").write_text("one\n")
    git("add", "a.txt")
    git("commit", "-q", "-m", "one")
    monkeypatch.setattr(machine, "REPO", tmp_path)
    monkeypatch.delenv("BENCH_COMMIT", raising=False)
    head = git("rev-parse", "--short", "HEAD")
    (tmp_path / "untracked.txt").write_text("not part of the measured tree's changes\n")
    assert machine.commit() == head
    (tmp_path / "a.txt").write_text("two\n")
    assert machine.commit() == f"{head}+changes"
    monkeypatch.setenv("BENCH_COMMIT", "abc1234")
    assert machine.commit() == "abc1234"


def test_the_small_op_target_divides_the_forward_by_the_queue_only_trivial_op(
    tmp_path: Path,
) -> None:
    """bench.small_op holds the 2-token forward's p50 to 3x the queue-only worker's trivial
    op's (not the LoRA worker's), and the table splits each kind at its stages."""

    def result(ms: float) -> LatencyResult:
        stages = Stages(rows=[(0.001, 0.0, 0.0005, ms / 2000, 0.0)] * 3)
        return LatencyResult(Latency([ms / 1000] * 3), Latency([0.001] * 3), stages)

    args = small_op.parse_args(["--quick"])
    run = Run({"CPU": "x"}, tmp_path, "redis://", "postgresql://", 0.0)
    for forward, met in ((2.9, True), (3.1, False)):
        results = {small_op.TRIVIAL: result(1.0), small_op.TRIVIAL_LORA: result(0.5)}
        results[small_op.FORWARD] = result(forward)
        report = small_op.report(args, run, results)
        [target] = report.targets
        assert target.met is met and f"= {forward:.2f}×" in target.measured
        assert report.results["ratio_p50"] == pytest.approx(forward)
    [table] = report.body
    assert isinstance(table, Table) and len(list(table.rows)) == 3
