"""The benchmark harness and the terminal comparison (no timing is asserted: only structure and honesty)."""

from __future__ import annotations

import csv
import re

import pytest
import torch

from pergrad_viz import bench
from pergrad_viz.bench import peers
from pergrad_viz.cli.main import main

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
    from pergrad_viz.cli.main import build_parser

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
    from pergrad_viz.tutorial import data

    monkeypatch.setattr(data, "find_fashion_mnist", lambda: None)  # no full set either (data/, Debian's)
    monkeypatch.setattr(data, "missing_files", lambda dataset, root: [root / "FashionMNIST" / "raw" / "x"])
    assert main(["bench", "--batch-sizes", "2", "--hidden", "8", "--min-run-time", "0.001"]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("error: fashion-mnist not found")
    assert "python -m pergrad_viz.tutorial.sample.make_sample --root" in captured.err
    assert "benchmark" not in captured.err and captured.out == ""


# ------------------------------------------------------------------------- the models people fine-tune (zoo_hf)

FINE_TUNED_OUTPUT = {"gpt2": (2, 32, 1000), "llama": (2, 32, 1000), "lora-llama": (2, 32, 1000), "bert": (2, 10),
                     "hf-vit": (2, 10), "timm-vit": (2, 10), "convnext": (2, 10)}


def _need_fine_tuning_libraries():
    for name in ("transformers", "timm", "peft"):
        pytest.importorskip(name, reason=f"{name} is not installed (pip install -e '.[hf]')")


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
@pytest.mark.parametrize("name", list(FINE_TUNED_OUTPUT))
def test_fine_tuned_models_build_and_the_hand_written_vmap_is_the_loop(name):
    """Each bench model builds from its config (hidden 128, 2 layers), returns logits for one tensor, and the
    hand-written vmap row it is timed against equals the per-sample loop of tests/helpers.py, per sample."""
    from helpers import flatten_ref, ref_grads

    from pergrad_viz.bench import problems as bench_models

    _need_fine_tuning_libraries()
    assert name in bench_models.MODELS and bench_models.BATCH[name] == 16
    model, loss_fn, x, y = bench_models.problem(name, 2)
    output = model(x)
    assert isinstance(output, torch.Tensor) and tuple(output.shape) == FINE_TUNED_OUTPUT[name]
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert all("lora_" in n for n in trainable) == (name == "lora-llama")
    if name in ("gpt2", "llama", "lora-llama"):  # causal LM: labels are the ids, each sample its own token mean
        assert torch.equal(x, y) and x.dtype == torch.int64
    torch.testing.assert_close(bench_models.hand_written_vmap(model, loss_fn, x, y),
                               flatten_ref(ref_grads(model, loss_fn, x, y), 1), rtol=1e-4, atol=1e-6)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_cli_bench_of_a_hugging_face_model_prints_the_table(capsys):
    """`bench --model gpt2`: the loop, auto, the hand-written vmap and the references, each checked against the
    loop."""
    _need_fine_tuning_libraries()
    code = main(["bench", "--model", "gpt2", "--batch-sizes", "2", "--strategies", "loop", "--min-run-time",
                 "0.01", "--no-progress"])
    assert code == 0
    out = capsys.readouterr().out
    assert "per-sample gradients (B, P) of gpt2" in out
    rows = {cells[3]: cells for cells in (re.split(r"\s{2,}", line.strip()) for line in out.splitlines()
                                         if line.startswith("grads"))}
    assert {"loop", "auto", "hand vmap", "forward+backward", "memory floor"} <= set(rows)
    assert "auto = hooks" in rows["auto"][-1]
    assert max(float(rows[m][10]) for m in ("auto", "hand vmap")) < 1e-5


def test_a_peer_result_of_another_size_is_not_timed(monkeypatch):
    """Opacus gives GPT-2's and BERT's position embeddings (shared by the batch) a (1, ...) grad_sample."""
    def short_peer(name, model, loss_fn, x, y):  # one number short per sample
        named = list(model.named_parameters())
        return lambda: {n: torch.zeros(x.shape[0], p.numel() - (n == "fc1.weight")) for n, p in named}

    monkeypatch.setattr(bench.peer_libs, "make_peer", short_peer)
    rows = by_method(bench.sweep("grads", [4], [8], strategies=["hooks"], peers=["opacus"], **FAST))
    assert rows["opacus"].skipped and rows["opacus"].note == "not timed: 25,476 numbers, not 25,480"  # 4 x 6,370
# --- the per-call check's cost, fresh results, the targets ----------------------------------------------------------

def test_auto_has_a_row_without_the_check_and_its_cost_in_the_note():
    model, loss, x, y = bench.setting(4, 8)
    rows = by_method(bench.compare(model, loss, x, y, strategies=["auto"], min_run_time=0.02, rounds=3))
    assert list(rows)[:2] == ["auto", bench.UNCHECKED]
    assert rows[bench.UNCHECKED].max_abs_diff < 1e-5  # the same result, checked against auto's
    cost = bench.check_cost(rows)
    assert cost == pytest.approx((rows["auto"].median_s - rows[bench.UNCHECKED].median_s) / rows["auto"].median_s)
    assert f"check {cost:.0%} of the call" in rows["auto"].note


def test_no_unchecked_row_where_auto_computes_each_sample_alone():
    """auto = torch_func runs no per-call check: no 'verify=False' row, no cost in the note."""
    from torch import nn

    class Centre(nn.Module):  # subtracts the batch mean: the samples interact
        def forward(self, h):
            return h - h.mean(0, keepdim=True)

    model = nn.Sequential(nn.Linear(3, 4), Centre(), nn.Linear(4, 2))
    x, y = torch.randn(5, 3), torch.randn(5, 2)
    rows = by_method(bench.compare(model, nn.MSELoss(), x, y, strategies=["auto"], min_run_time=0.02, rounds=3))
    assert "auto = torch_func" in rows["auto"].note and bench.UNCHECKED not in rows  # after a NOISY warning maybe
    assert "% of the call" not in rows["auto"].note and bench.check_cost(rows) is None


def test_out_buffer_adds_the_fresh_row():
    rows = by_method(bench.sweep("grads", [4], [8], strategies=["auto"], out_buffer=True, **FAST))
    assert {"auto", bench.UNCHECKED, bench.FRESH} <= set(rows)
    assert rows[bench.FRESH].max_abs_diff < 1e-5
    assert rows[bench.FRESH].note.endswith("auto allocating its result (no out=)")


@pytest.mark.parametrize("name", ["scaleshift", "parent-param", "bilinear"])
def test_the_fallback_models_agree_with_the_hand_written_vmap(name):
    from pergrad_viz.bench import problems as bench_models

    model, loss, x, y = bench_models.problem(name, 3)
    assert name in bench_models.MODELS
    hand = bench_models.hand_written_vmap(model, loss, x, y)
    rows = bench.model_sweep(name, [3], strategies=["auto"], min_run_time=0.01, progress=False)
    assert by_method(rows)["hand vmap"].max_abs_diff < 1e-5 and hand.shape[0] == 3


def test_the_hand_written_jacrev_is_the_per_sample_jacobian():
    from helpers import ref_jacobian

    from pergrad_viz.bench import problems as bench_models

    model, _, x, _ = bench.setting(2, 8)
    jac = bench_models.hand_written_jacrev(model, x)
    want = torch.cat([t.reshape(2, 10, -1) for t in ref_jacobian(model, x).values()], dim=2)
    for b in range(2):
        torch.testing.assert_close(jac[b], want[b], rtol=1e-5, atol=1e-6)


def _record(label: str, seconds: float) -> bench.Record:
    return bench.Record(label, "grads", 32, None, seconds, 0.0, 0)


def test_the_targets_report_reads_every_goal_from_its_own_table(monkeypatch):
    from pergrad_viz.bench import targets as bt

    times = {"loop": 10.0, "auto": 1.0, bench.UNCHECKED: 0.8, bench.FRESH: 1.2, "hand vmap": 2.0,
             "torch_func": 3.0, "grad norms": 1.05, bench.FORWARD_BACKWARD: 1.0, bench.MEMORY_FLOOR: 0.1,
             "scan: grad norms": 1.25}
    settings = {goal.setting for goal in bt.GOALS}
    fake = {s: [_record(label, t) for label, t in times.items()] for s in settings}
    monkeypatch.setattr(bt, "measure_tables", lambda *args: fake)
    text = bt.report(min_run_time=0.01)
    goal_lines = text[text.index("## targets"):].splitlines()[3:]
    assert len(goal_lines) >= len(bt.GOALS) + len(bt.NOT_HERE)
    by_what = {}
    for goal, line in zip(bt.GOALS, goal_lines, strict=False):
        assert line.startswith(goal.setting) and goal.what in line
        by_what.setdefault(goal.what, line)
    assert by_what["loop / auto"].split()[-4:] == ["10x", ">=", "30x", "NO"]  # 10 / 1 against the MLP's 30
    check = by_what["check cost (auto - auto verify=False) / auto"]
    assert "0.2x" in check and check.endswith("NO")  # 20% against 10%
    assert by_what["auto fresh / auto (out=)"].rstrip().endswith("yes")  # 1.2 <= 1.3
    assert by_what["hand vmap / auto"].rstrip().endswith("yes")  # 2.0 >= 1.2
    assert by_what["auto / forward+backward"].split()[-4:] == ["1x", "<=", "2x", "yes"]
    assert by_what["forward+backward / scan: grad norms (throughput)"].rstrip().endswith("yes")  # 0.8 >= 0.7
    transformer_check = next(line for line in goal_lines if line.startswith("transformer") and "check cost" in line)
    assert transformer_check.rstrip().endswith("NO")  # 20% against 10%
    assert "explorer B=256 / hidden 512" in text


def test_the_targets_skip_a_model_whose_library_is_missing_and_measure_the_rest(monkeypatch):
    """Without the bench extra (torchvision), ``bench --targets`` timed for 20 s and then failed on ResNet-18."""
    from pergrad_viz.bench import targets as bt
    from pergrad_viz.core.extras import missing_extra

    real = bt.bench_models.problem

    def problem(name, batch, **kw):
        if name == "resnet18":
            raise missing_extra("torchvision", "the benchmark model 'resnet18'", extra="bench")
        return real(name, batch, **kw)

    monkeypatch.setattr(bt.bench_models, "problem", problem)
    monkeypatch.setattr(bt, "compare", lambda *args, **kw: [_record("auto", 1.0)])
    emitted = []
    tables = bt.measure_tables(0.01, scan_examples=0, models=("resnet18", "mlp"), emit=emitted.append)
    assert "mlp grads B=32" in tables and not any(s.startswith("resnet18") for s in tables)
    assert any(e.startswith("## resnet18: skipped (") and "pergrad-viz[bench]" in e for e in emitted)


def test_the_targets_cover_every_model_of_bench_model_and_issue_21s_rows():
    from pergrad_viz.bench import problems as bench_models
    from pergrad_viz.bench import targets as bt

    hand = {g.setting for g in bt.GOALS if g.what == "hand vmap / auto"}
    assert hand == {f"{name} grads B={b}" for name in bench_models.MODELS for b in (16, 32)}
    whats = {g.what for g in bt.GOALS}
    assert {"loop / auto", "hand vmap(jacrev) / auto", "auto fresh / auto (out=)",
            "check cost (auto - auto verify=False) / auto"} <= whats


def test_a_hand_written_jacobian_is_compared_in_the_flat_layout():
    """Found by a newcomer's probe: bench --targets showed the textbook vmap(jacrev) 1.5 off the loop, its (B, Y, P)
    compared with the loop's per-parameter blocks flattened another way; both are now laid out as flat=True lays
    them out."""
    from pergrad_viz.bench import problems as bench_models
    from pergrad_viz.bench.targets import HAND

    model, loss, x, y = bench_models.setting(2, 5)
    hand = (HAND, lambda: bench_models.hand_written_jacrev(model, x), "vmap(jacrev(functional_call))")
    records = bench.compare(model, loss, x, y, quantity="jacobian", strategies=["loop"], extras=[hand],
                            min_run_time=0.01)
    diffs = {r.strategy: r.max_abs_diff for r in records if r.max_abs_diff is not None}
    assert HAND in diffs and diffs[HAND] < 1e-5, diffs
