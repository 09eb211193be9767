"""pv.dp_step(distributed=True) under torchrun (2 processes, gloo, 127.0.0.1): the same step as one process given
the whole batch with the same seed (each rank clips its own samples, the sums are all-reduced, rank 0 draws the
noise once)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dp_two_ranks import problem

import pergrad_viz as pv
from pergrad_viz.bench.scans import free_port

HERE = Path(__file__).resolve().parent


def test_two_processes_give_the_step_of_one(tmp_path):
    out = tmp_path / "grads.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(HERE.parent.parent), str(HERE), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--nnodes=1",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}", str(HERE / "dp_two_ranks.py"), str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = torch.load(out)
    model, loss_fn, x, y = problem()
    pv.dp_step(model, loss_fn, x, y, 0.3, noise_multiplier=1.5, generator=torch.Generator().manual_seed(7))
    for n, p in model.named_parameters():
        torch.testing.assert_close(two[n], p.grad, rtol=1e-12, atol=1e-14)
    noiseless = pv.clipped_grad_sum(model, loss_fn, x, y, 0.3)
    assert all(not torch.allclose(two[n] * 10, noiseless[n]) for n in noiseless)  # the noise is in it


def test_distributed_needs_a_process_group():
    model, loss_fn, x, y = problem()
    with pytest.raises(ValueError, match="init_process_group"):
        pv.clipped_grad_sum(model, loss_fn, x, y, 1.0, distributed=True)
