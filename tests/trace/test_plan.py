"""``tidekv plan``: the capacity model's arithmetic, the trace path, and its refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tidekv.cli import main
from tidekv.trace.plan import Load, MasterCosts, ModelShape, plan

SEVENTY_B = ModelShape(layers=80, kv_heads=8, head_dim=128, dtype_bytes=2, block_tokens=16)


def test_a_70b_class_model_in_a_terabyte_pool() -> None:
    f = plan(SEVENTY_B, 1 << 40, Load(prompts_per_s=10, prompt_tokens=32768, hit_rate=0.5),
             MasterCosts(bytes_per_object=500, exists_us_per_key=1, get_us_per_key=2, put_us_per_key=10))
    assert f["kv_bytes_per_token"] == 320 << 10  # 2 x 80 layers x 8 heads x 128 x 2 bytes
    assert f["object_bytes"] == 5 << 20  # 16 tokens
    assert f["objects"] == (1 << 40) // (5 << 20) == 209_715
    assert f["objects_one_per_run"] == 209_715 * 160, "K and V of each of 80 layers: 160 runs a block"
    assert f["master_memory_bytes"] == 209_715 * 500
    assert f["keys_per_prompt"] == 2048 and f["lookups_per_s"] == 20_480
    assert f["gets_per_s"] == f["puts_per_s"] == 10_240
    assert f["master_cores"] == pytest.approx((20_480 * 1 + 10_240 * 2 + 10_240 * 10) / 1e6)
    assert f["network_bytes_per_s"] == 20_480 * (5 << 20)


def test_tensor_parallel_ranks_split_a_block_but_mla_does_not() -> None:
    tp4 = ModelShape(80, 8, 128, 2, 16, tp=4)
    assert tp4.object_bytes == (5 << 20) // 4
    assert plan(tp4, 1 << 40, Load(1, 160, 0))["keys_per_prompt"] == 10 * 4
    mla = ModelShape(61, 1, 576, 2, 64, tp=8, mla=True)
    assert mla.kv_bytes_per_token == 61 * 576 * 2 and mla.object_bytes == 61 * 576 * 2 * 64


def test_the_command_from_a_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "trace.jsonl"
    lines = [{"timestamp": i * 1000, "input_length": 1024, "output_length": 8, "hash_ids": [1, 2]} for i in range(11)]
    trace.write_text("\n".join(json.dumps(line) for line in lines))
    assert main(["plan", "--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--pool", "64GiB",
                 "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    assert "1.10 prompts/s of 1,024 tokens, 91% of prompt tokens found" in out  # 11 in 10 s; all but the first hit
    assert "keys per prompt (every rank)" in out and "64" in out


def test_the_command_wants_a_whole_load(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit, match="give --prompt-rate, --prompt-tokens and --hit-rate, or --trace FILE"):
        main(["plan", "--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--pool", "1GiB", "--prompt-rate", "1"])
    with pytest.raises(SystemExit, match="--hit-rate 1.5: a share"):
        main(["plan", "--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--pool", "1GiB", "--prompt-rate", "1",
              "--prompt-tokens", "100", "--hit-rate", "1.5"])
