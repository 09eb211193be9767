"""pv.dp_step(distributed=True) under torchrun (2 processes, gloo, 127.0.0.1): the same step as one process given
the whole batch with the same seed (each rank clips its own samples, the sums are all-reduced, rank 0 draws the
noise once), whichever rank holds the samples, none at all included; processes passing different models or bounds,
or empty batches with no expected batch size, fail alike on every rank and stay in step."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dp_two_ranks import PER_LAYER, SPLITS, problem

import pergrad_viz as pv
from pergrad_viz.bench.scans import free_port

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    """{case: .grad or error message} of the 2-process run (dp_two_ranks.py)."""
    out = tmp_path_factory.mktemp("ranks") / "grads.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(HERE.parent.parent), str(HERE), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--nnodes=1",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}", str(HERE / "dp_two_ranks.py"), str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out)


def one_process(**options) -> dict[str, torch.Tensor]:
    model, loss_fn, x, y = problem()
    pv.dp_step(model, loss_fn, x, y, options.pop("max_norm", 0.3), noise_multiplier=1.5,
               generator=torch.Generator().manual_seed(7), **options)
    return {n: p.grad for n, p in model.named_parameters()}


def assert_same(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("case", [*SPLITS, "even, again"])
def test_two_processes_give_the_step_of_one_wherever_the_samples_are(two, case):
    assert_same(two[case], one_process())


def test_the_noise_is_in_it(two):
    model, loss_fn, x, y = problem()
    noiseless = pv.clipped_grad_sum(model, loss_fn, x, y, 0.3)
    assert all(not torch.allclose(two["even"][n] * 10, noiseless[n]) for n in noiseless)


def test_per_layer_bounds_with_an_empty_process(two):
    assert_same(two["per_layer, rank 1 empty"], one_process(max_norm=None, per_layer=PER_LAYER))


def test_empty_batches_on_every_process_take_the_noise_step_of_one(two):
    model = problem()[0]
    want = pv.noise_step(model, 0.3, noise_multiplier=1.5, generator=torch.Generator().manual_seed(7),
                         expected_batch_size=4)
    assert_same(two["both empty"], want)
    assert_same(two["noise_step"], want)


@pytest.mark.parametrize(("case", "message"), [
    ("both empty, no expected size", "empty batches on every process.*expected_batch_size="),
    ("different models", r"processes passed different trainable parameters \(names, shapes and dtypes\) \(rank 0: .*"
                         r"\(5, 6\).*; rank 1: .*\(6, 6\)"),  # each process's value named (found by a probe)
    ("different bounds", r"processes passed different clipping .*\(rank 0: \(\(\(0\.3, .*; rank 1: \(\(\(1\.3, "),
    ("different expected sizes", r"processes passed different clipping .*expected_batch_size\) \(rank 0: .*, 5\); "
                                 r"rank 1: .*, 10\)"),
])
def test_disagreeing_processes_fail_alike_on_every_rank(two, case, message):
    assert isinstance(two[case], str)
    assert re.search(message, two[case]), two[case]


def test_an_error_in_one_process_reaches_every_process(two):
    """Rank 1's batch holds a NaN sample: rank 1 raises its own error, rank 0 is told in the counting all-reduce
    and raises too, instead of waiting on rank 1 (and both take the next step together)."""
    rank0, rank1 = two["one process fails"]
    assert rank1.startswith("ValueError: sample(s) [2] of this batch have a gradient that is not finite"), rank1
    assert rank0.startswith("RuntimeError: distributed=True: 1 other process(es) raised an error"), rank0


def test_an_argument_refused_on_one_process_reaches_every_process(two):
    """Found by a probe: rank 1's missing generator was refused before the counting all-reduce, so rank 0's call
    paired with rank 1's next one (a wrong step, then a hang); now the refusal is told there, as a model's error."""
    rank0, rank1 = two["rank 1 argument error"]
    assert rank1.startswith("ValueError: noise_multiplier > 0 needs generator="), rank1
    assert rank0.startswith("RuntimeError: distributed=True: 1 other process(es) raised an error"), rank0


def test_a_failed_step_leaves_rank_0s_noise_generator_where_it_was(two):
    """Rank 1's empty inputs with 5 targets are refused; rank 0 had drawn its noise: put back, so the step again
    draws the noise one process draws."""
    assert two["rank 0's noise kept"] == [True, True]


def test_every_batch_empty_without_an_expected_size_leaves_rank_0s_generator_too(two):
    """Found by a probe: that refusal came after rank 0 drew the noise, never put back (its later steps' noise was
    not one process's)."""
    assert two["rank 0's noise kept, every batch empty"] == [True, True]


def test_the_repeated_noise_warning_is_rank_0s_alone(two):
    """Found by a probe: rank 1's generator, which never draws, was warned of as repeating at every step."""
    assert two["repeated-noise warnings"] == [0, 0]


def test_distributed_needs_a_process_group():
    model, loss_fn, x, y = problem()
    with pytest.raises(ValueError, match="init_process_group"):
        pv.clipped_grad_sum(model, loss_fn, x, y, 1.0, distributed=True)
    with pytest.raises(ValueError, match="init_process_group"):
        pv.noise_step(model, 1.0, noise_multiplier=1.0, generator=torch.Generator(), expected_batch_size=2,
                      distributed=True)


def test_a_ddp_model_steps_with_distributed_true_and_is_refused_without(two):
    """Found by a probe: dp_step on a DistributedDataParallel model with distributed=False wrote each process's own
    sum into .grad (DDP's all-reduce never ran): the replicas drifted apart (0.063 after 3 steps), silently."""
    message = two["DDP, distributed=False"]
    assert message.startswith("ValueError: the model is wrapped in DistributedDataParallel") and \
        "distributed=True" in message
    for name, grad in two["even"].items():  # the step of one process given all the samples
        torch.testing.assert_close(two["DDP, distributed=True"][name], grad)
