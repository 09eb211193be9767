"""Run by tests/derived/test_dp_distributed.py under torchrun: each rank takes its own samples of one fixed batch,
pv.dp_step(distributed=True), rank 0 saves .grad to the file named on the command line."""

import sys

import torch
from torch import nn

import pergrad_viz as pv


def problem():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(10, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (10,), generator=g)
    return model, nn.CrossEntropyLoss(), x, y


if __name__ == "__main__":
    torch.distributed.init_process_group("gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model, loss_fn, x, y = problem()
    mine = slice(rank * 10 // world, (rank + 1) * 10 // world)  # rank 0: samples 0-4, rank 1: 5-9
    pv.dp_step(model, loss_fn, x[mine], y[mine], 0.3, noise_multiplier=1.5,
               generator=torch.Generator().manual_seed(7 + rank), distributed=True)  # only rank 0 draws
    grads = {n: p.grad for n, p in model.named_parameters()}
    gathered = [None] * world
    torch.distributed.all_gather_object(gathered, grads)
    if rank == 0:
        assert all(torch.equal(g[n], grads[n]) for g in gathered for n in grads), "ranks disagree"
        torch.save(grads, sys.argv[1])
    torch.distributed.destroy_process_group()
