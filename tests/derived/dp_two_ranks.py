"""Run by tests/derived/test_dp_distributed.py under torchrun: each rank takes its own samples of one fixed batch
(an even split, then all on one rank and none on the other, as Poisson sampling may draw, then none on either) and
calls pv.dp_step(distributed=True); then calls that must fail on every rank alike (different models, empty batches
with no expected batch size). Rank 0 saves {case: .grad or the error's message} to the file named on the command
line."""

import sys
import warnings

import torch
from torch import nn

import pergrad_viz as pv


def problem():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(10, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (10,), generator=g)
    return model, nn.CrossEntropyLoss(), x, y


SPLITS = {"even": (5, 5), "rank 1 empty": (10, 0), "rank 0 empty": (0, 10)}
PAIRED = {"one process fails", "rank 0's noise kept", "rank 1 argument error", "repeated-noise warnings",
          "rank 0's noise kept, every batch empty"}  # each rank's own outcome
PER_LAYER = {"0": 0.2, "2": 0.4}


def step(rank, mine, **options):
    model, loss_fn, x, y = problem()
    generator = None if options.pop("generator_none", False) else torch.Generator().manual_seed(7 + rank)
    pv.dp_step(model, loss_fn, x[mine], y[mine], options.pop("max_norm", 0.3), noise_multiplier=1.5,
               generator=generator, distributed=True, **options)  # only rank 0 draws
    return {n: p.grad for n, p in model.named_parameters()}


def failure(call):
    try:
        call()
    except (ValueError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


if __name__ == "__main__":
    torch.distributed.init_process_group("gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    results = {}
    for case, sizes in SPLITS.items():
        first = sum(sizes[:rank])
        results[case] = step(rank, slice(first, first + sizes[rank]))
    results["per_layer, rank 1 empty"] = step(rank, slice(0, 10 if rank == 0 else 0), max_norm=None,
                                              per_layer=PER_LAYER)
    results["both empty"] = step(rank, slice(0, 0), expected_batch_size=4)
    model = problem()[0]
    pv.noise_step(model, 0.3, noise_multiplier=1.5, generator=torch.Generator().manual_seed(7 + rank),
                  expected_batch_size=4, distributed=True)
    results["noise_step"] = {n: p.grad for n, p in model.named_parameters()}
    results["both empty, no expected size"] = failure(lambda: step(rank, slice(0, 0)))
    wider = nn.Sequential(nn.Linear(6, 5 + rank), nn.Tanh(), nn.Linear(5 + rank, 3)).double()
    x, y = problem()[2:]
    results["different models"] = failure(lambda: pv.clipped_grad_sum(wider, nn.CrossEntropyLoss(), x[:5], y[:5],
                                                                      0.3, distributed=True))
    results["different bounds"] = failure(lambda: step(rank, slice(5 * rank, 5 * rank + 5), max_norm=0.3 + rank))
    def one_rank_fails():
        model, loss_fn, x, y = problem()
        x[7, 0] = float("nan")  # in rank 1's samples: its own error; rank 0 is told, not left waiting
        return pv.clipped_grad_sum(model, loss_fn, x[5 * rank:5 * rank + 5], y[5 * rank:5 * rank + 5], 0.3,
                                   distributed=True)

    results["one process fails"] = failure(one_rank_fails)
    noise = torch.Generator().manual_seed(7)
    before = noise.get_state()
    failure(lambda: pv.dp_step(*problem()[:2], problem()[2][:0] if rank else problem()[2][:5],
                               problem()[3][:5], 0.3, noise_multiplier=1.5, generator=noise, distributed=True))
    results["rank 0's noise kept"] = torch.equal(noise.get_state(), before)  # rank 1's batch: 0 inputs, 5 targets
    # an argument refused on one process alone (rank 1 passes no generator): told in the counting all-reduce
    results["rank 1 argument error"] = failure(lambda: step(rank, slice(5 * rank, 5 * rank + 5), generator_none=rank))
    results["different expected sizes"] = failure(lambda: step(rank, slice(5 * rank, 5 * rank + 5),
                                                              expected_batch_size=5 + 5 * rank))
    results["even, again"] = step(rank, slice(5 * rank, 5 * rank + 5))  # the processes still in step
    model, loss_fn, x, y = problem()
    wrapped = torch.nn.parallel.DistributedDataParallel(model)
    results["DDP, distributed=False"] = failure(lambda: pv.dp_step(wrapped, loss_fn, x[5 * rank:5 * rank + 5],
                                                                   y[5 * rank:5 * rank + 5], 0.3, noise_multiplier=0.0))
    pv.dp_step(wrapped, loss_fn, x[5 * rank:5 * rank + 5], y[5 * rank:5 * rank + 5], 0.3, noise_multiplier=1.5,
               generator=torch.Generator().manual_seed(7 + rank), distributed=True)
    results["DDP, distributed=True"] = {n: p.grad for n, p in model.named_parameters()}
    model, loss_fn, x, y = problem()
    noise = torch.Generator().manual_seed(7 + rank)  # made once: rank 1's never draws, and says nothing of it
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            pv.dp_step(model, loss_fn, x[5 * rank:5 * rank + 5], y[5 * rank:5 * rank + 5], 0.3, noise_multiplier=1.5,
                       generator=noise, distributed=True)
    results["repeated-noise warnings"] = sum("noise repeats" in str(w.message) for w in caught)
    before = noise.get_state()
    failure(lambda: pv.dp_step(model, loss_fn, x[:0], y[:0], 0.3, noise_multiplier=1.5, generator=noise,
                               distributed=True))  # every batch empty, no expected size: refused as one process's
    results["rank 0's noise kept, every batch empty"] = torch.equal(noise.get_state(), before)
    gathered = [None] * world
    torch.distributed.all_gather_object(gathered, results)
    if rank == 0:
        for case, mine in results.items():
            other = gathered[1][case]
            if case in PAIRED:
                results[case] = [mine, other]
                continue
            same = other == mine if isinstance(mine, str) else all(torch.equal(other[n], mine[n]) for n in mine)
            assert same, f"ranks disagree: {case}"
        torch.save(results, sys.argv[1])
    torch.distributed.destroy_process_group()
