"""The benchmark harness and the terminal comparison (no timing is asserted: only structure and honesty)."""

from __future__ import annotations

import csv
import re

import pytest
import torch

from pergrad_viz import bench, peers
from pergrad_viz.__main__ import main

FAST = {"min_run_time": 1e-3, "progress": False}


def by_method(records):
    return {r.strategy: r for r in records}


def test_sweep_records_every_strategy_and_the_references():
    records = bench.sweep("grads", [3], [8], **FAST)
    rows = by_method(records)
    assert list(rows) == [*bench.STRATEGIES, bench.FORWARD_BACKWARD, bench.MEMORY_FLOOR]
    p = 784 * 8 + 8 + 8 * 10 + 10
    for r in records:
        assert (r.quantity, r.batch_size, r.hidden, r.result_bytes) == ("grads", 3, 8, 3 * p * 4)
        assert r.median_s > 0 and r.iqr_s >= 0
    loop = rows["loop"].median_s
    assert rows["loop"].speedup_vs_loop == pytest.approx(1.0)
    assert rows["hooks"].speedup_vs_loop == pytest.approx(loop / rows["hooks"].median_s)
    assert rows[bench.FORWARD_BACKWARD].vs_forward_backward == pytest.approx(1.0)
    assert rows[bench.MEMORY_FLOOR].vs_memory_floor == pytest.approx(1.0)
    assert all(rows[s].max_abs_diff < 1e-5 for s in bench.STRATEGIES)  # the results agree


def test_slow_strategies_are_skipped_with_a_note():
    records = bench.sweep("jacobian", [4], [8], slow_limit=40, **FAST)
    rows = by_method(records)
    assert not rows["loop"].skipped  # 4 x 10 = 40 sample-backward passes: at the limit
    for name in ("autograd_stack", "batched_grad"):  # 40 passes over the whole batch of 4: 160
        assert rows[name].skipped and rows[name].median_s is None
        assert rows[name].note == "skipped: 160 sample-backward passes > slow_limit=40"
    assert rows["hooks"].result_bytes == 4 * 10 * (784 * 8 + 8 + 80 + 10) * 4


def test_backward_work():
    assert bench.backward_work("loop", "grads", 8, 1) == 8
    assert bench.backward_work("loop", "jacobian", 8, 10) == 80
    assert bench.backward_work("autograd_stack", "jacobian", 8, 10) == 640
    assert bench.backward_work("hooks", "jacobian", 8, 10) == 0


def test_chunk_and_norm_rows():
    records = bench.sweep("grads", [4], [8], strategies=["auto"], chunk_sizes=[2], norms=True, **FAST)
    rows = by_method(records)
    assert "auto = hooks" in rows["auto"].note  # after a NOISY warning when the machine is busy
    assert "auto chunk=2" in rows and rows["auto chunk=2"].max_abs_diff < 1e-5
    assert rows["grad norms"].result_bytes == 4 * 4 and rows["grads + norm"].max_abs_diff < 1e-4


@pytest.mark.skipif(not all(peers.available(p) for p in peers.PEERS), reason="opacus / backpack not installed")
def test_peers_are_checked_then_timed():
    rows = by_method(bench.sweep("grads", [4], [8], strategies=["hooks"], peers=list(peers.PEERS), **FAST))
    for name in peers.PEERS:
        assert not rows[name].skipped, rows[name].note
        assert rows[name].max_abs_diff < 1e-5


def test_a_peer_that_disagrees_is_not_timed(monkeypatch):
    def wrong_peer(name, model, loss_fn, x, y):
        return lambda: {n: torch.zeros(x.shape[0], *p.shape) for n, p in model.named_parameters()}

    monkeypatch.setattr(bench.peer_libs, "make_peer", wrong_peer)
    rows = by_method(bench.sweep("grads", [4], [8], strategies=["hooks"], peers=["opacus"], **FAST))
    assert rows["opacus"].skipped and rows["opacus"].note.startswith("not timed: disagrees with pergrad_viz by")


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown quantity 'hessian'"):
        bench.sweep("hessian", [2], [8], **FAST)
    with pytest.raises(ValueError, match="unknown strategy 'fast'.*'auto'"):
        bench.sweep("grads", [2], [8], strategies=["fast"], **FAST)
    with pytest.raises(ValueError, match="peers compute per-sample gradients only"):
        bench.sweep("jacobian", [2], [8], peers=["opacus"], **FAST)


def test_table_is_aligned_and_readable():
    records = bench.sweep("grads", [2], [8], strategies=["loop", "hooks"], **FAST)
    lines = bench.format_table(records).splitlines()
    assert lines[0].split()[:4] == ["quantity", "batch", "hidden", "method"]
    assert set(lines[1]) <= {"-", " "}
    assert [line.split()[3] for line in lines[2:]] == ["loop", "hooks", "forward+backward", "memory"]
    assert len({line.index("grads") for line in lines[2:]}) == 1


def test_cli_prints_a_table_and_writes_csv_and_png(tmp_path, capsys):
    csv_path, png_path = tmp_path / "r.csv", tmp_path / "r.png"
    code = main(["bench", "--quantity", "jacobian", "--batch-sizes", "2,3", "--hidden", "8", "--strategies",
                 "loop,hooks", "--min-run-time", "0.001", "--no-progress", "--csv", str(csv_path),
                 "--plot", str(png_path)])
    out = capsys.readouterr().out
    assert code == 0
    assert "# jacobian on MLP(784, hidden, 10), float32, cpu" in out
    table = [line for line in out.splitlines() if line.startswith("jacobian ")]
    assert [(line.split()[1], line.split()[3]) for line in table] == [
        ("2", "loop"), ("2", "hooks"), ("2", "forward+backward"), ("2", "memory"),
        ("3", "loop"), ("3", "hooks"), ("3", "forward+backward"), ("3", "memory")]
    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 8 and rows[1]["strategy"] == "hooks" and float(rows[1]["median_s"]) > 0
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(("argv", "message"), [
    (["bench", "--batch-sizes", "0"], "positive integers"),
    (["bench", "--strategies", "fast"], "unknown strategy fast"),
    (["bench", "--peers", "jax"], "unknown peer jax"),
])
def test_cli_rejects_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    assert message in capsys.readouterr().err


def test_cli_peers_need_gradients(capsys):
    assert main(["bench", "--quantity", "jacobian", "--peers", "opacus", "--no-progress"]) == 2
    assert "--peers compute per-sample gradients only" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["transformer", "lstm"])
def test_cli_model_bench_has_the_hand_written_vmap_and_the_reference_rows(name, capsys):
    """`bench --model NAME`: every strategy named, the hand-written vmap (checked against them), the references."""
    code = main(["bench", "--model", name, "--batch-sizes", "2", "--strategies", "hooks,torch_func",
                 "--min-run-time", "0.02", "--no-progress"])
    assert code == 0
    out = capsys.readouterr().out
    assert f"per-sample gradients (B, P) of {name}" in out
    rows = {cells[3]: cells for cells in (re.split(r"\s{2,}", line.strip()) for line in out.splitlines()
                                         if line.startswith("grads"))}
    assert {"hooks", "torch_func", "auto", "hand vmap", "forward+backward", "memory floor"} <= set(rows)
    assert "auto = hooks" in rows["auto"][-1]
    assert max(float(rows[m][10]) for m in ("hooks", "torch_func", "auto", "hand vmap")) < 1e-4


def test_interleaved_rows_report_spread_and_noise():
    model, loss, x, y = bench.setting(4, 8)
    records = bench.compare(model, loss, x, y, strategies=["hooks"], min_run_time=0.02, rounds=3)
    assert [r.strategy for r in records] == ["hooks", "forward+backward", "memory floor"]
    assert all(r.median_s > 0 and r.iqr_s >= 0 for r in records)
    assert all(("NOISY" in r.note) == (r.iqr_s / r.median_s > 0.25) for r in records)


# --- the command line's help -------------------------------------------------------------------------

COLUMNS = ("quantity", "batch", "hidden", "method", "median", "IQR", "vs loop", "vs fwd+bwd", "vs floor", "result",
           "max |diff|", "note")


def _help(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as info:
        main([*argv, "--help"])
    assert info.value.code == 0
    return capsys.readouterr().out


def _subparsers():
    from pergrad_viz.__main__ import build_parser

    parser = build_parser()
    (sub,) = [a for a in parser._actions if a.choices and isinstance(a.choices, dict)]
    return parser, sub.choices


def test_every_option_of_every_subcommand_has_help_and_states_its_default():
    parser, subcommands = _subparsers()
    assert set(subcommands) == {"bench", "scan", "scan-bench"}
    for name, sub in subcommands.items():
        for action in sub._actions:
            if action.dest == "help":
                continue
            where = f"{name} {'/'.join(action.option_strings)}"
            assert action.help, f"{where} has no help text"
            assert "default:" in action.help or "(required)" in action.help, f"{where} does not state its default"


@pytest.mark.parametrize("argv", [(), ("bench",), ("scan",), ("scan-bench",)])
def test_help_is_plain_text(argv, capsys):
    text = _help(capsys, *argv)
    for markup in ("``", ":func:", ":data:", ":class:", "::\n", "`"):
        assert markup not in text, f"raw markup {markup!r} in {' '.join(argv) or 'top-level'} --help"
    assert "cnn.pt" not in text  # no checkpoint that nothing creates


def test_bench_help_explains_every_column_of_the_table(capsys):
    text = _help(capsys, "bench")
    epilog = text[text.index("the table, one row per method and setting:"):]
    for column in COLUMNS:
        assert re.search(rf"^  {re.escape(column)}\s", epilog, re.M), f"column {column!r} is not explained"
    assert "between this result and the loop's" in epilog  # what max |diff| is measured against
    words = " ".join(text.split())  # the option help is wrapped to the terminal's width
    assert "(default: 2,32,128; 32 with --model)" in words and "(default: float32)" in words


def test_top_level_help_names_the_subcommands_and_the_version(capsys):
    import pergrad_viz

    text = _help(capsys)
    assert all(f"  {name} " in text for name in ("bench", "scan", "scan-bench"))
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.strip() == f"pergrad-viz {pergrad_viz.__version__}"


def test_the_printed_legend_names_the_reference_of_max_diff(capsys):
    assert main(["bench", "--batch-sizes", "2", "--hidden", "8", "--strategies", "loop,hooks", "--min-run-time",
                 "0.001", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "# max |diff| = largest element-wise |difference| from the loop's result (the definition)" in out
    assert main(["bench", "--batch-sizes", "2", "--hidden", "8", "--strategies", "hooks,torch_func",
                 "--min-run-time", "0.001", "--no-progress"]) == 0
    assert "from the hooks result" in capsys.readouterr().out


def test_a_missing_sample_is_one_clear_error_before_any_progress_bar(monkeypatch, capsys):
    from pergrad_viz import data

    monkeypatch.setattr(data, "_missing_files", lambda dataset, root: [root / "FashionMNIST" / "raw" / "x"])
    assert main(["bench", "--batch-sizes", "2", "--hidden", "8", "--min-run-time", "0.001"]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("error: fashion-mnist not found")
    assert "python -m pergrad_viz.sample.make_sample --root" in captured.err
    assert "benchmark" not in captured.err and captured.out == ""
