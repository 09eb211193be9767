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
