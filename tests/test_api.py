"""Every error and its message; the model is left exactly as it was, after success and after every error."""

from __future__ import annotations

import os
import re
import time

import pytest
import torch
from helpers import (
    TwoDtypes,
    assert_no_hooks,
    assert_state_unchanged,
    forked_result,
    ref_grads,
    ref_jacobian,
    snapshot,
)
from torch import nn

import pergrad_viz as pv
from pergrad_viz import api
from pergrad_viz.core.trainable import Trainable
from pergrad_viz.strategies import hooks

ALL = (*pv.STRATEGIES, "auto")
QUANTITIES = ("grads", "jacobian")


def run(quantity, model, x, y, loss=None, **kw):
    if quantity == "grads":
        return pv.per_sample_grads(model, loss or nn.CrossEntropyLoss(), x, y, **kw)
    return pv.per_sample_jacobian(model, x, **kw)


def small_model(*layers: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), *layers, nn.Linear(6, 3)).double()


def data(b=4):
    torch.manual_seed(1)
    return torch.randn(b, 4, dtype=torch.float64), torch.arange(b) % 3


class StateNet(nn.Module):
    """Linear, LayerNorm, BatchNorm1d (eval), Dropout (eval), frozen parts, a custom buffer."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 6)
        self.bn = nn.BatchNorm1d(6)
        self.ln = nn.LayerNorm(6)
        self.drop = nn.Dropout(0.5)
        self.fc2 = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)
        self.fc2.weight.requires_grad_(False)
        self.register_buffer("offset", torch.linspace(-1, 1, 6))
        self.calls = 0
        self.fail_at = None  # raise on this call of forward, after the first layer ran

    def forward(self, x):
        self.calls += 1
        h = torch.tanh(self.bn(self.fc1(x)))
        if self.fail_at is not None and self.calls >= self.fail_at:
            self.train(not self.training)  # even a forward that flips modes before failing is undone
            raise Boom(f"forward call {self.calls}")
        h = self.drop(self.ln(h + self.offset))
        return self.head(torch.tanh(self.fc2(h)))


class Boom(RuntimeError):
    pass


def state_net(mode: str) -> StateNet:
    torch.manual_seed(2)
    model = StateNet().double()
    model.bn.running_mean.uniform_(-0.3, 0.3)
    model.bn.running_var.uniform_(0.5, 1.5)
    if mode == "train":  # train mode, with the layers that need it in eval
        model.train()
        model.bn.eval()
        model.drop.eval()
    else:
        model.eval()
        model.ln.train()  # mixed flags must be kept too
    # known .grad on some parameters, None on others
    model.fc1.weight.grad = torch.full_like(model.fc1.weight, 0.25)
    model.head.bias.grad = torch.arange(3, dtype=torch.float64)
    model.fc2.weight.grad = torch.ones_like(model.fc2.weight)  # frozen but with a .grad
    assert model.fc1.bias.grad is None and model.head.weight.grad is None
    return model


# ------------------------------------------------------------------------------------------ mode errors


@pytest.mark.parametrize("quantity", QUANTITIES)
@pytest.mark.parametrize("strategy", ALL)
def test_batchnorm_in_training_mode(quantity, strategy):
    model = small_model(nn.BatchNorm1d(6)).train()
    x, y = data()
    before = snapshot(model)
    with pytest.raises(pv.UnsupportedModelError, match=r"'?1'? \(BatchNorm1d\).*batch statistics") as info:
        run(quantity, model, x, y, strategy=strategy)
    assert "model.eval()" in str(info.value) and "GroupNorm" in str(info.value)
    assert isinstance(info.value, ValueError)
    assert_state_unchanged(model, before)  # running statistics untouched: no forward ran


@pytest.mark.parametrize("quantity", QUANTITIES)
def test_batchnorm_without_running_stats(quantity):
    model = small_model(nn.BatchNorm1d(6, track_running_stats=False)).eval()
    x, y = data()
    with pytest.raises(pv.UnsupportedModelError, match=r"batch statistics.*track_running_stats=False\), so even in "
                                                       r"eval mode.*track_running_stats=True.*GroupNorm") as info:
        run(quantity, model, x, y)
    assert "model.eval()" not in str(info.value)  # it is in eval mode already: that cannot help


@pytest.mark.parametrize("quantity", QUANTITIES)
def test_dropout_in_training_mode(quantity):
    model = small_model(nn.Dropout(0.3)).train()
    x, y = data()
    with pytest.raises(pv.UnsupportedModelError, match=r"layer '1' \(Dropout\) is in training mode.*model\.eval\(\)"):
        run(quantity, model, x, y)
    # eval mode, or p=0 in training mode, is fine and deterministic
    for m in (small_model(nn.Dropout(0.3)).eval(), small_model(nn.Dropout(0.0)).train()):
        got = pv.per_sample_grads(m, nn.CrossEntropyLoss(), x, y)
        want = ref_grads(m, nn.CrossEntropyLoss(), x, y)
        for n in want:
            torch.testing.assert_close(got[n], want[n], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("quantity", QUANTITIES)
def test_embedding_with_max_norm(quantity):
    model = nn.Sequential(nn.Embedding(5, 6, max_norm=1.0), nn.Flatten(), nn.Linear(12, 3)).double()
    x = torch.tensor([[0, 1], [2, 3]])
    weight = model[0].weight.detach().clone()
    with pytest.raises(pv.UnsupportedModelError, match=r"max_norm=1\.0.*max_norm=None"):
        run(quantity, model, x, torch.tensor([0, 1]))
    assert torch.equal(model[0].weight, weight)  # not renormalised


@pytest.mark.parametrize("call", ["grads", "jacobian", "clipped_grad_sum"])
@pytest.mark.parametrize("kw", [{"max_norm": 0.5}, {"scale_grad_by_freq": True}], ids=["max_norm", "by_freq"])
def test_embedding_bag_refused_as_embedding_is(kw, call):
    model = nn.Sequential(nn.EmbeddingBag(5, 6, mode="sum", **kw), nn.Linear(6, 3)).double()
    x, y = torch.tensor([[0, 1], [1, 1]]), torch.tensor([0, 1])
    weight = model[0].weight.detach().clone()
    fix = "max_norm=None" if "max_norm" in kw else "scale_grad_by_freq=False"
    with pytest.raises(pv.UnsupportedModelError, match=rf"layer '0' \(EmbeddingBag\) has .*EmbeddingBag with {fix}"):
        if call == "clipped_grad_sum":
            pv.clipped_grad_sum(model, nn.CrossEntropyLoss(reduction="sum"), x, y, 1.0)
        else:
            run(call, model, x, y)
    assert torch.equal(model[0].weight, weight)  # not renormalised


@pytest.mark.parametrize("quantity", QUANTITIES)
@pytest.mark.parametrize("strategy", ALL)
def test_embedding_scaling_gradients_by_batch_frequency(quantity, strategy):
    model = nn.Sequential(nn.Embedding(5, 6, scale_grad_by_freq=True), nn.Flatten(), nn.Linear(12, 3)).double()
    x = torch.tensor([[0, 1], [1, 1]])
    with pytest.raises(pv.UnsupportedModelError,
                       match=r"layer '0' \(Embedding\) has scale_grad_by_freq=True.*other samples"):
        run(quantity, model, x, torch.tensor([0, 1]), strategy=strategy)


class Custom(nn.Module):
    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(6))

    def forward(self, x):
        return x * self.gain


@pytest.mark.parametrize("quantity", QUANTITIES)
@pytest.mark.parametrize(("layer", "type_name"), [(nn.utils.parametrizations.weight_norm(nn.Linear(6, 6)), "Linear"),
                                                 (Custom(), "Custom")])
def test_hooks_on_a_layer_without_a_rule_uses_the_per_layer_fallback(quantity, layer, type_name):
    model = nn.Sequential()
    model.add_module("body", nn.Sequential(nn.Linear(4, 6), layer))
    model.add_module("head", nn.Linear(6, 3))
    model.double()
    x, y = data()
    assert hooks.describe(Trainable.of(model), x) == {"body.0": "rule", "body.1": "fallback", "head": "rule"}
    before = snapshot(model)
    got = run(quantity, model, x, y, strategy="hooks")
    assert_state_unchanged(model, before)
    want = ref_grads(model, nn.CrossEntropyLoss(), x, y) if quantity == "grads" else ref_jacobian(model, x)
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, rtol=1e-10, atol=1e-12)
    assert pv.resolve_strategy("auto", model, x) == "hooks"


# ------------------------------------------------------------------------------------------ memory budget


@pytest.mark.parametrize("quantity", QUANTITIES)
@pytest.mark.parametrize("strategy", ALL)
def test_memory_budget_raised_before_allocation(quantity, strategy, monkeypatch):
    torch.manual_seed(0)
    model = nn.Linear(1000, 1000).double()  # P ~ 1e6
    x = torch.zeros(1, 1000, dtype=torch.float64).expand(2000, 1000)  # B = 2000: result ~ 16 GB (x 1000 for J)
    y = torch.zeros(2000, 1000, dtype=torch.float64).expand(2000, 1000)

    def no_run(*a, **k):
        raise AssertionError("the result was about to be allocated")

    monkeypatch.setattr(api, "_run", no_run)
    start = time.perf_counter()
    with pytest.raises(pv.MemoryBudgetError) as info:
        run(quantity, model, x, y, loss=nn.MSELoss(), strategy=strategy, max_bytes=1)
    assert time.perf_counter() - start < 5
    assert isinstance(info.value, MemoryError)
    msg = str(info.value)
    assert re.search(r"about \d+\.\d\d (KiB|MiB|GiB|TiB)", msg), msg
    assert "chunk_size" in msg and "smaller batch" in msg and "max_bytes" in msg
    assert "budget of 1 B" in msg


def test_memory_budget_estimate_values():
    model = nn.Linear(10, 10).double()  # P = 110
    x, y = torch.zeros(8, 10, dtype=torch.float64), torch.zeros(8, 10, dtype=torch.float64)
    # result 8 x 110 x 8 B = 7040 B; loop needs no working memory, torch_func one chunk more
    with pytest.raises(pv.MemoryBudgetError, match=r"about 6\.88 KiB .*result 6\.88 KiB.*working memory 0 B"):
        pv.per_sample_grads(model, nn.MSELoss(), x, y, strategy="loop", max_bytes=7039)
    pv.per_sample_grads(model, nn.MSELoss(), x, y, strategy="loop", max_bytes=7040)
    with pytest.raises(pv.MemoryBudgetError, match=r"about 7\.73 KiB .*working memory 880 B for chunks of 1"):
        pv.per_sample_grads(model, nn.MSELoss(), x, y, strategy="torch_func", chunk_size=1, max_bytes=7040)
    # with out=, the result is not allocated: only the working memory counts
    out = torch.empty(8, 110, dtype=torch.float64)
    assert pv.per_sample_grads(model, nn.MSELoss(), x, y, strategy="loop", max_bytes=0, flat=True, out=out) is out
    with pytest.raises(pv.MemoryBudgetError, match=r"in your out= buffer"):
        pv.per_sample_grads(model, nn.MSELoss(), x, y, strategy="torch_func", max_bytes=10, flat=True, out=out)


def test_default_budget_refuses_an_impossible_result(monkeypatch):
    model = nn.Linear(1000, 1000).double()
    x = torch.zeros(1, 1000, dtype=torch.float64).expand(10**6, 1000)  # result 8 TB
    monkeypatch.setattr(api, "_run", lambda *a, **k: pytest.fail("allocated"))
    with pytest.raises(pv.MemoryBudgetError, match=r"TiB.*50% of the memory available on cpu"):
        pv.per_sample_grads(model, nn.MSELoss(), x, x, strategy="loop")


# --------------------------------------------------------------------------------------- input errors


def test_batch_sizes_differ():
    model, (x, y) = small_model(), data(4)
    with pytest.raises(ValueError, match=r"batch sizes differ: inputs has 4 samples, targets has 3 samples"):
        pv.per_sample_grads(model, nn.CrossEntropyLoss(), x, y[:3])
    with pytest.raises(ValueError, match=r"batch sizes differ: .*targets has a scalar"):
        pv.per_sample_grads(model, nn.CrossEntropyLoss(), x, y[0])


def test_a_list_of_samples_is_told_to_stack():
    model, (x, y) = small_model(), data(3)  # 3 samples of 4 features
    with pytest.raises(ValueError, match=r"no input tensor has 3 .*list of one tensor per sample\? Stack them"):
        pv.per_sample_grads(model, nn.CrossEntropyLoss(), list(x), y)
    with pytest.raises(ValueError, match=r"no input tensor has 3 .*dimension\)$"):  # a tuple of other inputs: no hint
        pv.per_sample_grads(model, nn.CrossEntropyLoss(), (x[0], x[1]), y)


@pytest.mark.parametrize("quantity", QUANTITIES)
def test_unknown_strategy_lists_valid_names(quantity):
    model, (x, y) = small_model(), data()
    with pytest.raises(ValueError, match=r"unknown strategy 'vmap'") as info:
        run(quantity, model, x, y, strategy="vmap")
    for name in ALL:
        assert repr(name) in str(info.value)


@pytest.mark.parametrize("quantity", QUANTITIES)
def test_no_trainable_parameters(quantity):
    model = small_model().requires_grad_(False)
    x, y = data()
    with pytest.raises(ValueError, match=r"no trainable parameters.*requires_grad_\(True\)"):
        run(quantity, model, x, y)
    with pytest.raises(ValueError, match=r"no trainable parameters"):
        run(quantity, nn.ReLU(), x, y)


@pytest.mark.parametrize("quantity", QUANTITIES)
def test_empty_batch(quantity):
    model, (x, y) = small_model(), data()
    with pytest.raises(ValueError, match=r"empty batch: inputs has shape \(0, 4\)"):
        run(quantity, model, x[:0], y[:0])


@pytest.mark.parametrize("quantity", QUANTITIES)
def test_inputs_dtype_differs_from_model(quantity):
    model, (x, y) = small_model(), data()
    with pytest.raises(ValueError, match=r"inputs are torch\.float32 but the model's parameters are torch\.float64"):
        run(quantity, model, x.float(), y)


@pytest.mark.parametrize("chunk_size", [0, -1, 1.5, True, "2"])
def test_bad_chunk_size(chunk_size):
    model, (x, y) = small_model(), data()
    with pytest.raises(ValueError, match=r"chunk_size must be a positive int"):
        pv.per_sample_grads(model, nn.CrossEntropyLoss(), x, y, chunk_size=chunk_size)


def test_type_errors():
    model, (x, y) = small_model(), data()
    with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module"):
        pv.per_sample_grads(lambda t: t, nn.CrossEntropyLoss(), x, y)
    with pytest.raises(TypeError, match=r"inputs must be a torch\.Tensor"):
        pv.per_sample_grads(model, nn.CrossEntropyLoss(), x.tolist(), y)
    with pytest.raises(TypeError, match=r"targets must be a torch\.Tensor"):
        pv.per_sample_grads(model, nn.CrossEntropyLoss(), x, y.tolist())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available")
def test_inputs_on_another_device():
    model, (x, y) = small_model(), data()
    with pytest.raises(ValueError, match=r"inputs are on cuda:0 but the model's parameters are on cpu"):
        pv.per_sample_grads(model, nn.CrossEntropyLoss(), x.cuda(), y.cuda())


# ---------------------------------------------------------------------------------------- model state


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("quantity", QUANTITIES)
@pytest.mark.parametrize("strategy", ALL)
def test_state_unchanged_after_success(strategy, quantity, mode):
    model = state_net(mode)
    x, y = data(5)
    assert_no_hooks(model)
    before = snapshot(model)
    result = run(quantity, model, x, y, strategy=strategy, chunk_size=2)
    assert_no_hooks(model)
    assert_state_unchanged(model, before)
    assert all(torch.isfinite(t).all() for t in result.values())
    assert "fc2.weight" not in result and "fc2.bias" in result


def _error_cases():
    """name -> (callable(model, strategy) that must raise, expected exception, match)."""
    x, y = data(5)
    ce = nn.CrossEntropyLoss()

    def calls_then_raise(n):
        count = [0]

        def loss(o, t):
            count[0] += 1
            if count[0] >= n:
                raise Boom(f"loss call {count[0]}")
            return ce(o, t)

        return loss

    def forward_fails(quantity):
        def go(model, strategy):
            model.fail_at = 2
            try:
                run(quantity, model, x, y, strategy=strategy, chunk_size=2)
            finally:
                model.fail_at, model.calls = None, 0
        return go

    return {
        "loss-raises-2nd-call": (lambda m, s: pv.per_sample_grads(m, calls_then_raise(2), x, y, strategy=s,
                                                                  chunk_size=2), Boom, "loss call"),
        "forward-raises-grads": (forward_fails("grads"), Boom, "forward call"),
        "forward-raises-jacobian": (forward_fails("jacobian"), Boom, "forward call"),
        "memory-budget": (lambda m, s: pv.per_sample_grads(m, ce, x, y, strategy=s, max_bytes=1),
                          pv.MemoryBudgetError, "budget"),
        "memory-budget-jacobian": (lambda m, s: pv.per_sample_jacobian(m, x, strategy=s, max_bytes=1),
                                   pv.MemoryBudgetError, "budget"),
        "batch-sizes": (lambda m, s: pv.per_sample_grads(m, ce, x, y[:2], strategy=s), ValueError, "batch sizes"),
        "empty-batch": (lambda m, s: pv.per_sample_jacobian(m, x[:0], strategy=s), ValueError, "empty batch"),
        "dtype": (lambda m, s: pv.per_sample_grads(m, ce, x.float(), y, strategy=s), ValueError, "float32"),
        "bad-out": (lambda m, s: pv.per_sample_grads(m, ce, x, y, strategy=s, flat=True,
                                                     out=torch.empty(5, 1, dtype=torch.float64)),
                    ValueError, "does not fit"),
        "bad-targets": (lambda m, s: pv.per_sample_grads(m, ce, x, y + 10, strategy=s, chunk_size=2),
                        (IndexError, RuntimeError), None),
        "dropout-train": (lambda m, s: pv.per_sample_grads(m, ce, x, y, strategy=s),
                          pv.UnsupportedModelError, "Dropout"),
        "batchnorm-train": (lambda m, s: pv.per_sample_jacobian(m, x, strategy=s),
                            pv.UnsupportedModelError, "BatchNorm1d"),
    }


ERROR_CASES = _error_cases()


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("case", list(ERROR_CASES))
@pytest.mark.parametrize("strategy", ALL)
def test_state_unchanged_after_errors(strategy, case, mode):
    model = state_net(mode)
    fn, exc, match = ERROR_CASES[case]
    if case in ("dropout-train", "batchnorm-train"):
        getattr(model, "drop" if case == "dropout-train" else "bn").train()
    before = snapshot(model)
    with pytest.raises(exc, match=match):
        fn(model, strategy)
    assert_no_hooks(model)
    assert_state_unchanged(model, before)
    # and the model still works, with the same results as the reference
    if case in ("dropout-train", "batchnorm-train"):
        return
    x, y = data(5)
    got = pv.per_sample_grads(model, nn.CrossEntropyLoss(), x, y, strategy=strategy)
    want = ref_grads(model, nn.CrossEntropyLoss(), x, y)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("strategy", ALL)
def test_user_hooks_are_kept_and_called(strategy):
    model = state_net("eval")
    seen = []
    handle = model.fc1.register_forward_hook(lambda m, a, o: seen.append(o.shape[0]))
    pre = model.head.register_forward_pre_hook(lambda m, a: None)
    before = snapshot(model)
    x, y = data(4)
    pv.per_sample_grads(model, nn.CrossEntropyLoss(), x, y, strategy=strategy)
    assert_state_unchanged(model, before)
    assert seen, "the user's hook was not called"
    handle.remove()
    pre.remove()
    assert_no_hooks(model)


def test_resolve_strategy_checks_modes_before_running_the_model():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).train()
    before = snapshot(model)
    with pytest.raises(pv.UnsupportedModelError, match="batch statistics"):
        pv.resolve_strategy("auto", model, torch.randn(3, 4))
    assert_state_unchanged(model, before)  # running statistics untouched: the model never ran


def test_rrelu_in_training_mode_is_refused():
    model = nn.Sequential(nn.Linear(4, 4), nn.RReLU(), nn.Linear(4, 3)).train()
    with pytest.raises(pv.UnsupportedModelError, match=r"layer '1' \(RReLU\) is in training mode.*model\.eval\(\)"):
        pv.per_sample_grads(model, nn.CrossEntropyLoss(), torch.randn(3, 4), torch.tensor([0, 1, 2]))
    model.eval()
    assert pv.per_sample_grads(model, nn.CrossEntropyLoss(), torch.randn(3, 4), torch.tensor([0, 1, 2]))


def test_targets_on_another_device_are_refused_before_allocating():
    model = nn.Linear(4, 3)
    with pytest.raises(ValueError, match=r"targets are on meta but inputs are on cpu.*targets\.to\('cpu'\)"):
        pv.per_sample_grads(model, nn.MSELoss(), torch.randn(2, 4), torch.empty(2, 3, device="meta"))
    # inputs away from targets and the model: the inputs are named (it said targets.to('meta'), found by a probe)
    with pytest.raises(ValueError, match=r"inputs are on meta but targets and the model's parameters are on cpu.*"
                                         r"inputs\.to\('cpu'\)"):
        pv.per_sample_grads(model, nn.MSELoss(), torch.randn(2, 4, device="meta"), torch.randn(2, 3))


def test_trainable_parameters_of_two_dtypes_give_the_loop_or_a_refusal_naming_it():
    model, x, y = TwoDtypes(), torch.randn(5, 6), torch.tensor([0, 1, 2, 0, 1])
    loss = nn.CrossEntropyLoss()
    params = [p for p in model.parameters()]
    want = [torch.autograd.grad(loss(model(x[i:i + 1]), y[i:i + 1]), params) for i in range(5)]
    for strategy in ("auto", "loop"):
        got = pv.per_sample_grads(model, loss, x, y, strategy=strategy)
        for k, (name, _) in enumerate(model.named_parameters()):
            torch.testing.assert_close(got[name].double(), torch.stack([w[k] for w in want]).double())
    norms = torch.stack([torch.cat([g.double().reshape(-1) for g in w]) for w in want]).norm(dim=1)
    torch.testing.assert_close(pv.per_sample_grad_norms(model, loss, x, y).double(), norms, rtol=1e-5, atol=1e-7)
    for strategy in ("hooks", "torch_func"):
        with pytest.raises(pv.UnsupportedModelError, match="several dtypes.*strategy='auto' or 'loop'"):
            pv.per_sample_grads(model, loss, x, y, strategy=strategy)


@pytest.mark.parametrize(("call", "name"), [
    (lambda m, x, y: pv.per_sample_grads(m, nn.MSELoss(), x, y, flat="yes"), "flat"),
    (lambda m, x, y: pv.per_sample_grads(m, nn.MSELoss(), x, y, verify="no"), "verify"),
    (lambda m, x, y: pv.per_sample_jacobian(m, x, verify=None), "verify"),
    (lambda m, x, y: pv.per_sample_grad_norms(m, nn.MSELoss(), x, y, verify=1), "verify"),
    (lambda m, x, y: pv.empirical_ntk(m, x, verify="no"), "verify"),
])
def test_a_flag_that_is_not_a_bool_is_refused(call, name):
    """``"no"`` is truthy: a flag is True or False, else a TypeError naming it (found by a newcomer's probe)."""
    model, x, y = nn.Linear(3, 2), torch.randn(4, 3), torch.randn(4, 2)
    with pytest.raises(TypeError, match=f"{name} must be True or False"):
        call(model, x, y)


def test_calls_on_one_model_from_two_threads_run_one_at_a_time():
    """Found by a probe: two threads calling on one model saw each other's forward in their hooks (plan mismatches,
    'no trainable parameter takes part'); the calls on one model now take turns, each right."""
    import threading

    torch.manual_seed(0)
    model, loss = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).double(), nn.CrossEntropyLoss()
    batches = [(torch.randn(6, 5, dtype=torch.float64), torch.randint(0, 3, (6,))) for _ in range(2)]
    wants = [ref_grads(model, loss, x, y) for x, y in batches]
    failures = []

    def work(k):
        x, y = batches[k]
        for _ in range(8):
            try:
                got = pv.per_sample_grads(model, loss, x, y)
                for name, w in wants[k].items():
                    torch.testing.assert_close(got[name], w, rtol=1e-10, atol=1e-12)
            except Exception as e:  # noqa: BLE001 (collected, asserted below)
                failures.append(repr(e))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not failures, failures[:2]


def test_calls_on_two_models_sharing_a_layer_from_two_threads_take_turns():
    """Found by a probe: two models sharing a trunk, each called from its own thread, took their locks per model, so
    one call's hooks on the trunk captured the other's forward (89 of 120 results wrong, silently). Here thread A's
    call waits inside its forward (up to 1 s) while thread B calls on the other model: B now waits for A."""
    import threading

    torch.manual_seed(0)
    trunk = nn.Sequential(nn.Linear(5, 8), nn.Tanh())
    inside, leave = threading.Event(), threading.Event()

    class _Pauses(nn.Linear):  # holds its first whole-batch forward open until the other thread has called (or 1 s)
        pause = False

        def forward(self, x):
            if self.pause and x.shape[0] == 6 and not inside.is_set():
                inside.set()
                leave.wait(timeout=1.0)
            return super().forward(x)

    model_a, model_b = (nn.Sequential(trunk, head).double() for head in (_Pauses(8, 3), nn.Linear(8, 3)))
    loss = nn.CrossEntropyLoss()
    (xa, ya), (xb, yb) = ((torch.randn(n, 5, dtype=torch.float64), torch.randint(0, 3, (n,))) for n in (6, 7))
    wants = {"a": ref_grads(model_a, loss, xa, ya), "b": ref_grads(model_b, loss, xb, yb)}
    model_a[1].pause = True
    got, failures = {}, []

    def work(key, model, x, y):
        try:
            got[key] = pv.per_sample_grads(model, loss, x, y)
        except Exception as e:  # noqa: BLE001 (collected, asserted below)
            failures.append(repr(e))
        finally:
            leave.set()

    a = threading.Thread(target=work, args=("a", model_a, xa, ya))
    a.start()
    assert inside.wait(timeout=60)
    work("b", model_b, xb, yb)
    a.join(timeout=120)
    assert not failures, failures[:2]
    for key, want in wants.items():
        for name, w in want.items():
            torch.testing.assert_close(got[key][name], w, rtol=1e-10, atol=1e-12)


def test_modules_that_compare_equal_each_have_their_own_lock():
    """Found by a review: the per-module locks were keyed by the modules' own __eq__ / __hash__, so two modules that
    compare equal shared one lock (two threads then took it and another in opposite orders: a deadlock)."""
    from pergrad_viz.core import trainable

    class ByConfig(nn.Linear):  # compared by its configuration
        def __eq__(self, other):
            return isinstance(other, ByConfig) and self.in_features == other.in_features

        def __hash__(self):
            return hash(self.in_features)

    a, b = ByConfig(4, 4), ByConfig(4, 4)
    with trainable._CALL_LOCKS_LOCK:
        assert trainable._lock_of(a) is not trainable._lock_of(b)
        assert trainable._lock_of(a) is trainable._lock_of(a)
    torch.manual_seed(0)
    model = nn.Sequential(ByConfig(4, 6), nn.Tanh(), ByConfig(6, 2)).double()  # unequal: torch.nn dedupes equal ones
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 2, (5,))
    got = pv.per_sample_grads(model, nn.CrossEntropyLoss(), x, y)
    for name, want in ref_grads(model, nn.CrossEntropyLoss(), x, y).items():
        torch.testing.assert_close(got[name], want, rtol=1e-10, atol=1e-12)


def _child_call(model, x, y, queue):
    torch.set_num_threads(1)
    queue.put(pv.per_sample_grads(model, nn.CrossEntropyLoss(), x, y)["0.weight"].tolist())  # by value


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_process_forked_while_another_thread_is_in_a_call_can_call_on_the_model():
    """Found by a probe: a process forked (multiprocessing 'fork', DataLoader workers) while a thread of the parent
    was inside a call on the model inherited that model's lock, held, and its first call on the model hung forever."""
    import threading

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    x, y = torch.randn(4, 5), torch.randint(0, 3, (4,))
    inside, leave = threading.Event(), threading.Event()

    class _Waits(nn.Module):  # a loss that holds the parent's call open until the child has forked
        def forward(self, output, target):
            inside.set()
            leave.wait(timeout=60)
            return nn.functional.cross_entropy(output, target)

    busy = threading.Thread(target=lambda: pv.per_sample_grads(model, _Waits(), x, y, strategy="loop"))
    busy.start()
    try:
        assert inside.wait(timeout=60)
        got = torch.tensor(forked_result(_child_call, model, x, y))
    finally:
        leave.set()
        busy.join(timeout=60)
    want = ref_grads(model, nn.CrossEntropyLoss(), x, y)["0.weight"]
    torch.testing.assert_close(got, want)
