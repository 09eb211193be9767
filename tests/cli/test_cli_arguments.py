"""Bad command-line values end in argparse's one-line error naming the option (found by a newcomer's probe: tracebacks
from deep inside for ``scan --limit 0``, ``--hidden 0``, ``--device cuda`` without CUDA)."""

from __future__ import annotations

import pytest
import torch

from pergrad_viz.cli.main import build_parser, main
from pergrad_viz.tutorial.networks import MLP

BAD = [
    (["scan", "--limit", "0"], "--limit: expected a positive integer"),
    (["scan", "--limit", "-5"], "--limit: expected a positive integer"),
    (["scan", "--model", "mlp", "--hidden", "0"], "--hidden: expected a positive integer"),
    (["scan", "--batch-size", "0"], "--batch-size: expected a positive integer"),
    (["scan", "--device", "gpu0"], "--device: expected a device such as cpu or cuda"),
    (["scan", "--seed", "-1"], "--seed: expected an integer >= 0"),  # these three: found late, by their Python names
    (["scan", "--model-seed", "-1"], "--model-seed: expected an integer >= 0"),
    (["scan", "--num-workers", "-1"], "--num-workers: expected an integer >= 0"),
    (["scan-bench", "--rounds", "0"], "--rounds: expected a positive integer"),
    (["bench", "--min-run-time", "-1"], "--min-run-time: expected a positive number"),
    (["bench", "--min-run-time", "nan"], "--min-run-time: expected a positive number"),
    (["bench", "--threads", "0"], "--threads: expected a positive integer"),
    (["bench", "--device", "gpu0"], "--device: expected a device such as cpu or cuda"),
]


@pytest.mark.parametrize(("argv", "message"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_a_bad_value_is_an_argparse_error_naming_the_option(argv, message, capsys, tmp_path):
    if argv[0] == "scan":
        argv = [*argv, "--out", str(tmp_path / "scan")]
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_a_cuda_device_names_the_cpu(capsys, tmp_path):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["scan", "--device", "cuda", "--out", str(tmp_path)])
    assert "use --device cpu" in capsys.readouterr().err


def test_bench_dp_refuses_the_jacobian(capsys):
    assert main(["bench", "--dp", "--quantity", "jacobian"]) == 2
    assert "use --quantity grads" in capsys.readouterr().err


def test_a_checkpoint_of_another_width_names_its_hidden(tmp_path, capsys):
    path = tmp_path / "mlp32.pt"
    torch.save(MLP(784, 32, 10).state_dict(), path)
    with pytest.raises(SystemExit) as info:
        main(["scan", "--model", "mlp", "--checkpoint", str(path), "--out", str(tmp_path / "scan"), "--limit", "4"])
    assert "pass --hidden 32" in str(info.value)


def test_the_projection_without_its_width_names_the_option(tmp_path, capsys):
    code = main(["scan", "--data", "fashion-mnist-sample", "--quantities", "projection", "--limit", "4",
                 "--out", str(tmp_path / "scan"), "--no-progress", "--model", "mlp"])
    assert code == 2
    assert "pass --proj-dim K" in capsys.readouterr().err


def test_the_chunk_size_help_states_the_default_it_uses(capsys):
    """It said 16 batches; pv.scan makes about 16 chunks, of at most 64 batches (found by a probe)."""
    with pytest.raises(SystemExit):
        build_parser().parse_args(["scan", "--help"])
    assert "about 16 chunks, at most 64 batches" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("saved", ["whole model", "not a checkpoint"])
def test_a_checkpoint_that_is_no_state_dict_names_how_to_save_one(tmp_path, saved):
    """Found by a newcomer's probe: a whole pickled model or a corrupt file gave torch's UnpicklingError / KeyError
    traceback, whose advice (add_safe_globals) is not the fix."""
    path = tmp_path / "model.pt"
    if saved == "whole model":
        torch.save(MLP(784, 20, 10), path)
    else:
        path.write_bytes(b"not a checkpoint" * 8)
    with pytest.raises(SystemExit) as info:
        main(["scan", "--model", "mlp", "--checkpoint", str(path), "--out", str(tmp_path / "scan"), "--limit", "4"])
    assert "torch.save(model.state_dict(), path)" in str(info.value)


def test_bench_output_files_are_checked_before_the_timing(tmp_path, capsys):
    """Found by a newcomer's probe: a --plot of an unknown format or a --csv into a missing folder raised a traceback
    after the whole benchmark had run."""
    assert main(["bench", "--plot", str(tmp_path / "p.txt")]) == 2
    assert "name the file e.g. plot.png" in capsys.readouterr().err
    assert main(["bench", "--csv", str(tmp_path / "missing" / "r.csv")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["bench", "--csv", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err


def test_bench_names_the_options_a_run_does_not_read(tmp_path, capsys):
    """Found by a newcomer's probe: --plot with --model (and others) were dropped silently."""
    assert main(["bench", "--dp", "--quantity", "jacobian", "--plot", str(tmp_path / "p.png"), "--norms"]) == 2
    err = capsys.readouterr().err
    assert "note: --plot is not used by --dp (only by the MLP sweep): ignored" in err
    assert "note: --norms is not used by --dp" in err


def test_an_interrupted_scan_says_its_chunks_are_kept(tmp_path, capsys, monkeypatch):
    """Found by a newcomer's probe: Ctrl-C printed a KeyboardInterrupt traceback through torch."""
    from pergrad_viz.cli import scan as cli_scan

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("pergrad_viz.scanning.api.scan", interrupted)
    assert cli_scan is not None
    code = main(["scan", "--data", "fashion-mnist-sample", "--model", "mlp", "--limit", "4",
                 "--out", str(tmp_path / "scan"), "--no-progress"])
    assert code == 130
    assert "rerun the same command to continue" in capsys.readouterr().err


def test_a_finished_scan_run_again_says_it_is_complete(tmp_path, capsys):
    argv = ["scan", "--data", "fashion-mnist-sample", "--model", "mlp", "--limit", "8", "--batch-size", "4",
            "--out", str(tmp_path / "scan"), "--no-progress"]
    assert main(argv) == 0
    capsys.readouterr()
    assert main(argv) == 0
    assert "is complete: all 8 examples were scanned before" in capsys.readouterr().out
