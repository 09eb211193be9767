"""Poisson-sampled batches and the accountant (Opacus', called, never re-derived here): values against Opacus called
directly and against the sampling's own statistics; noise_step; bad input."""

from __future__ import annotations

import math
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import pergrad_viz as pv
from pergrad_viz.derived import sums as sums_mod


def test_poisson_batches_are_seeded_independent_and_of_rate_q():
    q, n = 0.05, 400
    batches = list(pv.PoissonBatches(n, q, steps=200, generator=torch.Generator().manual_seed(0)))
    assert len(batches) == 200
    again = list(pv.PoissonBatches(n, q, steps=200, generator=torch.Generator().manual_seed(0)))
    assert batches == again
    sizes = torch.tensor([len(b) for b in batches], dtype=torch.float64)
    # Binomial(n, q): mean 20, std 4.36; the mean of 200 batches within 4 standard errors
    assert abs(float(sizes.mean()) - n * q) < 4 * math.sqrt(n * q * (1 - q) / 200)
    assert float(sizes.std()) > 2  # not a fixed batch size
    counts = torch.zeros(n)
    for b in batches:
        assert b == sorted(set(b)) and all(0 <= i < n for i in b)
        counts[b] += 1
    assert abs(float(counts.mean()) - 200 * q) < 0.5  # every example drawn at rate q
    state = torch.get_rng_state()
    list(pv.PoissonBatches(n, q, generator=torch.Generator().manual_seed(1)))
    assert torch.equal(torch.get_rng_state(), state)


def test_poisson_batches_in_a_dataloader():
    data = torch.utils.data.TensorDataset(torch.arange(50.0).unsqueeze(1), torch.arange(50))
    sampler = pv.PoissonBatches(50, 0.2, generator=torch.Generator().manual_seed(3))
    assert len(sampler) == 5 and sampler.expected_batch_size == 10
    loader = torch.utils.data.DataLoader(data, batch_sampler=sampler)
    batches = list(loader)
    assert len(batches) == 5 and all(torch.equal(x[:, 0].long(), y) for x, y in batches)


def test_a_dataloader_loop_takes_the_noise_step_on_an_empty_batch():
    """n q small: many batches are empty, which PyTorch's default_collate cannot collate; the sampler's collate
    gives 0 rows, and dp_step on them is the noise step (the steps the accountant counts all taken)."""
    torch.manual_seed(0)
    model, loss_fn = nn.Linear(4, 3).double(), nn.CrossEntropyLoss(reduction="sum")
    data = torch.utils.data.TensorDataset(torch.randn(20, 4, dtype=torch.float64), torch.randint(0, 3, (20,)))
    sampler = pv.PoissonBatches(len(data), 0.05, steps=30, generator=torch.Generator().manual_seed(0))
    with pytest.raises(IndexError):  # what the loop meets without it (PyTorch's collate of [])
        list(torch.utils.data.DataLoader(data, batch_sampler=sampler))
    noise, again = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    empty = 0
    for x, y in torch.utils.data.DataLoader(data, batch_sampler=sampler, collate_fn=sampler.collate(data)):
        assert x.shape[1:] == (4,) and x.dtype == torch.float64 and len(x) == len(y)
        pv.dp_step(model, loss_fn, x, y, 1.0, noise_multiplier=1.0, generator=noise, expected_batch_size=2)
        if len(y) == 0:
            empty += 1
            want = pv.noise_step(copy_of(model), 1.0, noise_multiplier=1.0, generator=again, expected_batch_size=2)
            assert torch.equal(model.weight.grad, want["weight"])
        else:
            pv.clipped_grad_sum(model, loss_fn, x, y, 1.0, noise_multiplier=1.0, generator=again)  # keeps in step
    assert empty > 5


def test_an_empty_batch_of_dict_examples_has_no_row_in_any_field():
    data = [{"x": torch.randn(3), "name": f"s{i}", "label": i % 2, "tags": ["a", "b"]} for i in range(20)]
    sampler = pv.PoissonBatches(len(data), 1e-6, steps=2, generator=torch.Generator().manual_seed(0))
    for batch in torch.utils.data.DataLoader(data, batch_sampler=sampler, collate_fn=sampler.collate(data)):
        assert batch["x"].shape == (0, 3) and batch["label"].shape == (0,) and batch["name"] == []
        assert [len(t) for t in batch["tags"]] == [0, 0]


def _pad(examples):
    """As DataCollatorWithPadding does: a BatchEncoding of padded tensors."""
    import transformers

    width = max(len(e["input_ids"]) for e in examples)
    return transformers.BatchEncoding({
        "input_ids": torch.tensor([e["input_ids"] + [0] * (width - len(e["input_ids"])) for e in examples]),
        "labels": torch.tensor([e["labels"] for e in examples])})


def test_an_empty_batch_of_a_hugging_face_collator_has_no_row_and_the_collate_pickles():
    """Found by a probe: DataCollatorWithPadding returns a BatchEncoding (a UserDict, not a dict), which the empty
    batch was not cut from: dataset[0] came as a 1-row batch and dp_step trained on it (in every empty batch); and
    the collate, a closure, could not be sent to DataLoader workers started by spawn (macOS, Windows)."""
    import pickle

    transformers = pytest.importorskip("transformers")
    data = [{"input_ids": [1, 2, 3][: 1 + i % 3], "labels": i % 2} for i in range(20)]

    sampler = pv.PoissonBatches(len(data), 1e-6, steps=2, generator=torch.Generator().manual_seed(0))
    collate = pickle.loads(pickle.dumps(sampler.collate(data, _pad)))  # as a spawned worker receives it
    batch = collate([])
    assert isinstance(batch, transformers.BatchEncoding)
    assert batch["input_ids"].shape[0] == 0 and batch["labels"].shape == (0,)
    assert collate([data[3], data[4]])["input_ids"].shape == (2, 2)
    with pytest.raises(TypeError, match="cannot make an empty batch from a collated object"):
        sampler.collate(data, lambda examples: object())([])


def _keep(examples):
    return examples


def _detection(examples):
    return tuple(zip(*examples, strict=True))


@pytest.mark.parametrize(("collate_fn", "want"), [(_keep, []), (_detection, ((), ()))], ids=["identity", "zip"])
def test_an_empty_batch_of_a_collate_that_keeps_the_examples_is_empty(collate_fn, want):
    """Found by a probe: a collate keeping the examples as they are (lambda b: b, a detection model's
    tuple(zip(*b))) gave an IndexError on a 0-dim label, or one-element tuples holding the first example's image."""
    data = [(torch.randn(3, 4, 4), {"boxes": torch.randn(2, 4), "label": torch.tensor(i % 2)}) for i in range(10)]
    sampler = pv.PoissonBatches(len(data), 1e-6, steps=1, generator=torch.Generator().manual_seed(0))
    assert sampler.collate(data, collate_fn)([]) == want


def copy_of(model: nn.Module) -> nn.Module:
    import copy

    twin = copy.deepcopy(model)
    for p in twin.parameters():
        p.grad = None
    return twin


def test_numpy_and_tensor_numbers_are_numbers():
    import numpy as np

    assert pv.epsilon(np.float64(1.1), np.float64(0.1), np.int64(20), np.float64(1e-5)) == pv.epsilon(
        1.1, 0.1, 20, 1e-5)
    assert pv.noise_multiplier_for(torch.tensor(3.0), 0.1, torch.tensor(20), 1e-5) == pv.noise_multiplier_for(
        3.0, 0.1, 20, 1e-5)
    assert len(pv.PoissonBatches(np.int64(100), np.float32(0.25), generator=torch.Generator())) == 4
    with pytest.raises(ValueError, match="steps must be a positive int"):
        pv.epsilon(1.0, 0.1, np.float64(2.5), 1e-5)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"n": 0}, "n must be a positive int"),
    ({"sample_rate": 0.0}, "sample_rate must be"),
    ({"sample_rate": 1.5}, "sample_rate must be"),
    ({"steps": 0}, "steps must be"),
])
def test_poisson_batches_refuse_bad_input(kwargs, match):
    args = {"n": 10, "sample_rate": 0.1, "generator": torch.Generator(), **kwargs}
    with pytest.raises(ValueError, match=match):
        pv.PoissonBatches(args.pop("n"), args.pop("sample_rate"), **args)
    with pytest.raises(TypeError, match="generator must be a torch.Generator"):
        pv.PoissonBatches(10, 0.1)


@pytest.mark.parametrize("accountant", ["rdp", "prv"])
def test_epsilon_is_opacus_accountant(accountant):
    accountants = pytest.importorskip("opacus.accountants")
    acc = accountants.RDPAccountant() if accountant == "rdp" else accountants.PRVAccountant()
    for _ in range(300):
        acc.step(noise_multiplier=1.1, sample_rate=0.01)
    want = acc.get_epsilon(delta=1e-5)
    got = pv.epsilon(1.1, 0.01, 300, 1e-5, accountant=accountant)
    assert got == pytest.approx(want, rel=1e-6)
    assert pv.epsilon(1.1, 0.01, 600, 1e-5, accountant=accountant) > got  # more steps, more privacy spent
    assert pv.epsilon(2.0, 0.01, 300, 1e-5, accountant=accountant) < got  # more noise, less


def test_the_prv_accountant_at_sample_rate_1_says_nothing():
    """Found by a probe: Opacus' PRV accountant at q = 1 let numpy's 'divide by zero encountered in log' through (its
    log(1 - q)); the value is Opacus' own."""
    accountants = pytest.importorskip("opacus.accountants")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = pv.epsilon(1.0, 1.0, 10, 1e-5, accountant="prv")
    acc = accountants.PRVAccountant()
    acc.history = [(1.0, 1.0, 10)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert got == pytest.approx(acc.get_epsilon(delta=1e-5), rel=1e-9)


def test_noise_multiplier_for_a_target_epsilon():
    pytest.importorskip("opacus")
    sigma = pv.noise_multiplier_for(2.0, 0.01, 1000, 1e-5)
    assert pv.epsilon(sigma, 0.01, 1000, 1e-5) <= 2.0
    assert pv.epsilon(sigma * 0.95, 0.01, 1000, 1e-5) > 1.9  # not much more noise than needed


def test_the_search_keeps_opacus_note_on_the_multipliers_it_tried_to_itself():
    """Opacus' RDP accountant warns "Optimal order is the largest alpha" for small multipliers its search tries on
    the way (found by a probe: the docs' example printed it for an answer it does not concern)."""
    pytest.importorskip("opacus")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sigma = pv.noise_multiplier_for(3.0, 0.064, 100, 1e-5)
    assert pv.epsilon(sigma, 0.064, 100, 1e-5) <= 3.0


def test_no_generator_is_needed_without_noise():
    x, y = torch.randn(6, 3, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
    model = nn.Linear(3, 2).double()
    loss = nn.MSELoss(reduction="sum")
    pv.dp_step(model, loss, x, y, 1.0, noise_multiplier=0.0, expected_batch_size=6)
    want = pv.clipped_grad_sum(model, loss, x, y, 1.0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n] / 6)
    pv.noise_step(model, 1.0, noise_multiplier=0.0, expected_batch_size=6)
    assert all(not p.grad.any() for p in model.parameters())
    for call in (lambda: pv.dp_step(model, loss, x, y, 1.0, noise_multiplier=1.0),
                 lambda: pv.noise_step(model, 1.0, noise_multiplier=1.0, expected_batch_size=6)):
        with pytest.raises(ValueError, match="needs generator="):
            call()


@pytest.mark.parametrize(("call", "match"), [
    (lambda: pv.epsilon(0.0, 0.01, 10, 1e-5), "noise_multiplier must be a finite number > 0"),
    (lambda: pv.epsilon(1.0, 0.01, 10, 1.0), "delta must be in"),
    (lambda: pv.epsilon(1.0, 0.01, 0, 1e-5), "steps must be a positive int"),
    (lambda: pv.epsilon(1.0, 0.01, 10, 1e-5, accountant="gdp"), "accountant must be one of"),
    (lambda: pv.noise_multiplier_for(-1.0, 0.01, 10, 1e-5), "target_epsilon must be"),
    (lambda: pv.noise_multiplier_for(1e-6, 0.01, 100, 1e-5), "take a larger target_epsilon, fewer steps"),
])
def test_accountant_refuses_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_noise_step_writes_noise_alone():
    model = nn.Linear(3, 2).double()
    pv.noise_step(model, 0.5, noise_multiplier=2.0, generator=torch.Generator().manual_seed(4), expected_batch_size=10)
    sums = sums_mod.initial_sums([(n, p.shape, p.dtype, p.device) for n, p in model.named_parameters()], 1.0,
                           torch.Generator().manual_seed(4))
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, sums[n] / 10)
    with pytest.raises(ValueError, match="needs generator="):
        pv.noise_step(model, 0.5, noise_multiplier=2.0, generator=None, expected_batch_size=10)


@pytest.mark.parametrize("inputs", [torch.zeros(0, 3, dtype=torch.float64),
                                    {"x": torch.zeros(0, 3, dtype=torch.float64)}], ids=["tensor", "dict"])
def test_dp_step_on_an_empty_batch_is_the_noise_step(inputs):
    """Poisson sampling draws an empty batch with probability (1 - q)^n: dp_step takes that step as noise alone
    (the step the accountant counts), as noise_step does; without expected_batch_size it names the fix."""
    model = nn.Linear(3, 2).double()
    loss_fn = nn.CrossEntropyLoss() if isinstance(inputs, torch.Tensor) else (lambda out, y: out.sum())
    targets = torch.zeros(0, dtype=torch.long)
    call_model = model if isinstance(inputs, torch.Tensor) else _DictInput(model)  # model(**inputs)
    pv.dp_step(call_model, loss_fn, inputs, targets, 0.5, noise_multiplier=2.0,
               generator=torch.Generator().manual_seed(4), expected_batch_size=10)
    sums = sums_mod.initial_sums([(n, p.shape, p.dtype, p.device) for n, p in call_model.named_parameters()], 1.0,
                                 torch.Generator().manual_seed(4))
    for n, p in call_model.named_parameters():
        torch.testing.assert_close(p.grad, sums[n] / 10)
    with pytest.raises(ValueError, match="expected_batch_size=.*noise_step"):
        pv.dp_step(call_model, loss_fn, inputs, targets, 0.5, noise_multiplier=2.0,
                   generator=torch.Generator().manual_seed(4))


def test_an_empty_batch_with_bounds_per_layer_draws_their_noise():
    """per_layer={prefix: bound} (max_norm=None): the empty batch's noise has the groups' sensitivity
    sqrt(sum_k C_k^2), in dp_step and noise_step alike."""
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2)).double()
    bounds = {"0": 0.3, "1": 0.4}  # sensitivity 0.5
    pv.dp_step(model, nn.CrossEntropyLoss(), torch.zeros(0, 3, dtype=torch.float64), torch.zeros(0, dtype=torch.long),
               None, noise_multiplier=2.0, generator=torch.Generator().manual_seed(4), expected_batch_size=10,
               per_layer=bounds)
    sums = sums_mod.initial_sums([(n, p.shape, p.dtype, p.device) for n, p in model.named_parameters()], 1.0,
                                 torch.Generator().manual_seed(4))
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, sums[n] / 10)
    again = pv.noise_step(model, None, noise_multiplier=2.0, generator=torch.Generator().manual_seed(4),
                          expected_batch_size=10, per_layer=bounds)
    for n in sums:
        torch.testing.assert_close(again[n], sums[n] / 10)


def test_dp_step_names_an_unknown_option():
    model = nn.Linear(3, 2).double()
    with pytest.raises(TypeError, match="unexpected keyword.*'chunks'"):
        pv.dp_step(model, nn.CrossEntropyLoss(), torch.zeros(2, 3, dtype=torch.float64),
                   torch.zeros(2, dtype=torch.long),
                   0.5, noise_multiplier=0.0, generator=None, chunks=2)


class _DictInput(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


@pytest.mark.parametrize(("options", "error", "match"), [
    ({"strateg": "hooks"}, TypeError, "unexpected keyword argument"),
    ({"strategy": "nope"}, ValueError, "unknown strategy 'nope'"),
    ({"randomness": "x"}, ValueError, "randomness must be"),
    ({"verify": "yes"}, TypeError, "verify must be True or False"),
    ({"targets": torch.zeros(7, dtype=torch.long)}, ValueError, "the inputs hold no sample but targets hold 7"),
])
def test_an_empty_batch_checks_the_step_as_a_full_one(options, error, match):
    """Poisson sampling's empty batch takes the noise step, after the same argument checks as any other batch."""
    model = nn.Linear(3, 2).double()
    targets = options.pop("targets", torch.zeros(0, dtype=torch.long))
    with pytest.raises(error, match=match):
        pv.dp_step(model, nn.CrossEntropyLoss(), torch.zeros(0, 3, dtype=torch.float64), targets, 0.5,
                   noise_multiplier=2.0, generator=torch.Generator().manual_seed(4), expected_batch_size=10, **options)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("count", [np.int64(10), torch.tensor(10)], ids=["numpy", "tensor"])
def test_expected_batch_size_is_any_whole_number(count):
    model = nn.Linear(3, 2).double()
    x, y = torch.randn(4, 3, dtype=torch.float64), torch.tensor([0, 1, 1, 0])
    steps = {}
    for key, size in (("int", 10), ("other", count)):
        steps[key] = {n: g.clone() for n, g in pv.dp_step(model, nn.CrossEntropyLoss(), x, y, 0.5, noise_multiplier=1.0,
                                                           generator=torch.Generator().manual_seed(4),
                                                           expected_batch_size=size).items()}
        pv.noise_step(model, 0.5, noise_multiplier=1.0, generator=torch.Generator().manual_seed(4),
                      expected_batch_size=size)
        steps[key + " noise"] = {n: p.grad.clone() for n, p in model.named_parameters()}
    for key in ("", " noise"):
        for n in steps["int" + key]:
            torch.testing.assert_close(steps["other" + key][n], steps["int" + key][n])


def test_empty_targets_of_a_full_batch_are_named():
    model = nn.Linear(3, 2).double()
    with pytest.raises(ValueError, match=r"batch sizes differ: targets hold no sample but inputs has shape \(7, 3\)"):
        pv.dp_step(model, nn.CrossEntropyLoss(), torch.randn(7, 3, dtype=torch.float64),
                   torch.zeros(0, dtype=torch.long), 0.5, noise_multiplier=0.0, generator=None)


def test_a_dataloader_without_the_samplers_collate_is_told_at_the_first_empty_batch():
    """Found by a newcomer's probe: batch_sampler=PoissonBatches without collate_fn ran until the first empty batch,
    then PyTorch's bare IndexError; iterated directly for index lists, an empty batch is fine and says nothing."""
    import warnings

    data = torch.utils.data.TensorDataset(torch.randn(30, 3), torch.randint(0, 2, (30,)))
    sampler = pv.PoissonBatches(30, 0.02, steps=40, generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert sum(1 for batch in sampler if not batch) > 0  # directly: empty lists, no warning
    with pytest.warns(UserWarning, match=r"collate_fn=sampler\.collate\(dataset\)"), pytest.raises(IndexError):
        for _ in torch.utils.data.DataLoader(data, batch_sampler=sampler):
            pass
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(list(torch.utils.data.DataLoader(data, batch_sampler=sampler, collate_fn=sampler.collate(data)))) \
            == 40


def test_the_accountants_import_leaves_logging_and_warnings_as_they_were():
    """Found by a probe: the first pv.epsilon imported Opacus, whose import calls logging.basicConfig (the user's own
    basicConfig(level=INFO) was then ignored) and adds warnings filters. In a fresh process: Opacus not imported yet."""
    pytest.importorskip("opacus")
    code = ("import logging, warnings\n"
            "import pergrad_viz as pv\n"
            "filters = list(warnings.filters)  # torch's and numpy's own, from their imports\n"
            "assert 'opacus' not in __import__('sys').modules\n"
            "eps = pv.epsilon(1.0, 0.064, 47, delta=1e-5)\n"
            "assert logging.getLogger().handlers == [], logging.getLogger().handlers\n"
            "assert warnings.filters == filters, [f for f in warnings.filters if f not in filters]\n"
            "print(round(eps, 2))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert float(done.stdout) > 0


def test_a_noised_step_over_its_own_batch_size_warns_and_names_the_expected_size():
    """Found by a probe (a newcomer): leaving out expected_batch_size with Poisson batches divided by each batch's own
    (private) size, silently; a step without noise (a check of the mechanics) says nothing."""
    torch.manual_seed(0)
    model, loss_fn = nn.Sequential(nn.Linear(4, 3)), nn.CrossEntropyLoss()
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    with pytest.warns(UserWarning, match="own size.*expected_batch_size=sampler.expected_batch_size") as caught:
        pv.dp_step(model, loss_fn, x, y, 1.0, noise_multiplier=1.0, generator=torch.Generator().manual_seed(0))
    assert caught[0].filename == __file__  # shown at the caller's line
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pv.dp_step(model, loss_fn, x, y, 1.0, noise_multiplier=0.0)
        pv.dp_step(model, loss_fn, x, y, 1.0, noise_multiplier=1.0, generator=torch.Generator().manual_seed(1),
                   expected_batch_size=5)


def test_the_own_size_warning_shows_once_per_line():
    """Found by a review: a catch_warnings around every call reset the warnings registry (the warning shown at every
    step, a user's own 'default' warnings again after each call)."""
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(4, 3)) for _ in range(2)]
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(4):
            pv.dp_step(models[0], nn.CrossEntropyLoss(), x, y, 1.0, noise_multiplier=1.0,
                       generator=torch.Generator().manual_seed(len(caught) + 7))
    assert sum("own size" in str(w.message) for w in caught) == 1


def test_clipped_grad_sum_of_an_empty_batch_names_dp_step():
    """Found by a probe: an empty Poisson batch given to clipped_grad_sum said only 'pass at least one sample'."""
    model = nn.Linear(6, 3)
    with pytest.raises(ValueError, match="clipped_grad_sum got no sample .* pv.dp_step takes it"):
        pv.clipped_grad_sum(model, nn.CrossEntropyLoss(), torch.zeros(0, 6), torch.zeros(0, dtype=torch.long), 1.0)
