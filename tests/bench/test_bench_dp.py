"""bench --dp: one table per model, every row's clipped sum checked against the loop's, peak memory read."""

from __future__ import annotations

import pytest

from pergrad_viz.bench import dp as bench_dp
from pergrad_viz.cli.main import main


def test_dp_table_rows_agree_with_the_loop():
    rows = bench_dp.dp_table("mlp", batch=4, rounds=1)
    by = {r["method"]: r for r in rows}
    assert {"forward+backward", "pv clipped_grad_sum", "pv, verify=False", "materialised + clip"} <= set(by)
    for name in ("pv clipped_grad_sum", "pv, verify=False", "materialised + clip"):
        assert by[name]["max_diff"] is not None and by[name]["max_diff"] < 1e-5
        assert by[name]["median_s"] > 0
    if "opacus ghost clipping" in by and by["opacus ghost clipping"]["median_s"] is not None:
        assert by["opacus ghost clipping"]["max_diff"] < 1e-5
    text = bench_dp.format_dp_table("mlp", rows, 4)
    assert "pv clipped_grad_sum" in text and "max |diff|" in text and "tensors MB" in text
    assert by["pv clipped_grad_sum"]["tensors"] > 0 and by["forward+backward"]["tensors_vs_plain"] == 1.0


def test_peak_bytes_sees_a_large_allocation():
    import torch

    peak = bench_dp.peak_bytes(lambda: torch.ones(4 << 20), "cpu")  # 16 MiB
    if peak is None:
        pytest.skip("peak memory cannot be read on this platform")
    assert peak > 12 << 20


def test_tensor_peak_bytes_sees_a_large_allocation_and_not_what_was_there_before():
    import torch

    held = torch.ones(8 << 20)  # 32 MiB alive before the call: not counted

    def call():
        a = torch.ones(4 << 20)  # 16 MiB, then 8 MiB more while it lives: 24 MiB at once
        b = torch.ones(2 << 20)
        del a, b
        c = torch.ones(4 << 20)  # 16 MiB after they were freed: still 24 MiB at most
        del c

    peak = bench_dp.tensor_peak_bytes(call, "cpu")
    if peak is None:
        pytest.skip("the profiler's memory records cannot be read here")
    assert 24 << 20 <= peak < 25 << 20
    del held


def test_cli_bench_dp(capsys):
    assert main(["bench", "--dp", "--model", "mlp", "--batch-sizes", "3"]) == 0
    out = capsys.readouterr().out
    assert "## mlp, B=3" in out and "materialised + clip" in out


def test_dp_rows_on_a_users_model_leaves_its_grad_and_agrees_with_the_loop():
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    x, y = torch.randn(6, 5), torch.tensor([0, 1, 2, 0, 1, 2])
    before = [torch.full_like(p, 0.5) for p in model.parameters()]
    for p, g in zip(model.parameters(), before, strict=True):
        p.grad = g
    rows = bench_dp.dp_rows(model, nn.CrossEntropyLoss(), x, y, rounds=1)
    assert all(p.grad is g for p, g in zip(model.parameters(), before, strict=True))
    by = {r["method"]: r for r in rows}
    assert rows[0]["method"] == "forward+backward" and rows[0]["vs_plain"] == 1.0
    for name in ("pv clipped_grad_sum", "materialised + clip"):
        assert by[name]["max_diff"] < 1e-6 and by[name]["median_s"] > 0


def test_a_missing_opacus_is_a_row_with_a_note(monkeypatch):
    monkeypatch.setattr(bench_dp.peers, "available", lambda name: False)
    rows = bench_dp.dp_table("mlp", batch=4, rounds=1)
    by = {r["method"]: r for r in rows}
    assert by["opacus ghost clipping"]["median_s"] is None
    assert "not installed: pip install opacus" in by["opacus ghost clipping"]["note"]


def test_the_opacus_ratio_says_where_opacus_computes_another_sum():
    """Found by a newcomer's probe: the transformer's Opacus row, 0.14 off the loop, was timed and its ratio printed as
    if both computed one result."""
    rows = [{"method": "forward+backward", "median_s": 1e-3, "iqr": 0.01, "vs_plain": 1.0, "peak": None,
             "peak_vs_plain": None, "max_diff": None, "note": ""},
            {"method": "opacus ghost clipping", "median_s": 2e-3, "iqr": 0.01, "vs_plain": 2.0, "vs_pv": 1.5,
             "peak": None, "peak_vs_plain": None, "max_diff": 0.14, "note": ""}]
    assert "not the same result" in bench_dp.format_dp_table("transformer", rows, 4)
    rows[1]["max_diff"] = 1e-7
    assert "not the same result" not in bench_dp.format_dp_table("transformer", rows, 4)
