"""The plan's cache key (pergrad_viz.engine.plan_key) sees every change that can make a cached plan stale, and
nothing else: the same model and inputs give the same key."""

from __future__ import annotations

import dataclasses
import enum

import torch
from torch import nn

from pergrad_viz.core.batch import Batch
from pergrad_viz.core.trainable import Trainable
from pergrad_viz.engine.plan_key import plan_key


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3))


class Mode(enum.Enum):
    A = "a"
    B = object()


@dataclasses.dataclass
class Settings:
    center: bool = False
    sizes: tuple = (1, 2)
    ids: dict = dataclasses.field(default_factory=dict)


def _with_settings(model: nn.Module) -> nn.Module:
    """Settings as models hold them: one config object shared by two layers (as Hugging Face's ``self.config``),
    an enum flag, a dict of flags."""
    model[1].config = model[2].config = Settings()
    model[0].mode, model[0].flags = Mode.A, {"skip": False}
    return model


def test_settings_are_read_afresh_but_not_their_identity_alone():
    model, x = _with_settings(_net()), torch.randn(3, 4)
    before = _key(model, x)
    model[1].config.ids["x"] = 1  # not a plain field: not read
    model[0].mode = Mode.A  # the same member again
    assert _key(model, x) == before
    key = _key(model, x)
    assert len(key[2]) == 1  # the shared object read once
    model[1].config.center = True
    assert _key(model, x)[2] != key[2]


def _key(model: nn.Module, x: torch.Tensor) -> tuple:
    return plan_key(Trainable.of(model), Batch.of(x))


def test_same_model_and_inputs_same_key():
    model, x = _net(), torch.randn(3, 4)
    assert _key(model, x) == _key(model, torch.randn(7, 4))  # the batch size is not part of it


def test_every_structural_change_changes_the_key():
    x = torch.randn(3, 4)
    changes = {
        "training flag": lambda m: m.eval(),
        "parameter replaced": lambda m: setattr(m[0], "weight", nn.Parameter(m[0].weight.detach().clone())),
        "parameter frozen": lambda m: m[2].bias.requires_grad_(False),
        "parameter reshaped": lambda m: setattr(m[2], "bias", nn.Parameter(torch.zeros(1))),
        "parameter dtype": lambda m: m.double(),
        "module replaced": lambda m: m.__setitem__(1, nn.Tanh()),
        "forward hook": lambda m: m[0].register_forward_hook(lambda *a: None),
        "forward pre-hook": lambda m: m[2].register_forward_pre_hook(lambda *a: None),
        "plain attribute": lambda m: setattr(m[1], "task", 2),
        "instance forward": lambda m: setattr(m[1], "forward", torch.tanh),
        "a settings object's field": lambda m: setattr(m[1].config, "center", True),
        "a settings object's nested tuple": lambda m: setattr(m[2].config, "sizes", (1, 3)),
        "an enum attribute": lambda m: setattr(m[0], "mode", Mode.B),
        "a dict attribute's item": lambda m: m[0].flags.update(skip=True),
    }
    for what, change in changes.items():
        model = _with_settings(_net())
        before = _key(model, x)
        change(model)
        assert _key(model, x.to(next(model.parameters()).dtype)) != before, what
    model = _net()
    assert _key(model, torch.randn(3, 4, dtype=torch.float64)) != _key(model, x), "input dtype"
    assert _key(nn.Sequential(nn.Linear(4, 3)), torch.randn(3, 4)) != _key(nn.Sequential(nn.Linear(4, 3)),
                                                                          torch.randn(3, 4)), "another model"


def test_a_hook_swapped_for_another_changes_the_key_one_made_anew_or_counting_does_not():
    """Found by a probe: the key counted hooks, so a hook swapped for one that centres the outputs over the batch
    (or a pre-hook for a forward hook) kept it, and the cached plan gave rows 0.16 off the loop, also unchecked
    (verify=False). Hooks are keyed by their code: the same code made anew each step, or a hook object that counts
    its calls, keeps the key (a counter would probe every call)."""
    model, x = _net(), torch.randn(3, 4)

    class Counting:
        calls = 0

        def __call__(self, module, args, output):
            self.calls += 1

    def identity():
        return lambda m, i, o: o

    counting = Counting()
    model[2].register_forward_hook(counting)
    handle = model[0].register_forward_hook(identity())
    before = _key(model, x)
    handle.remove()
    handle = model[0].register_forward_hook(identity())  # the same code, made anew
    counting.calls += 5
    assert _key(model, x) == before
    handle.remove()
    handle = model[0].register_forward_hook(lambda m, i, o: o - o.mean(0, keepdim=True))
    assert _key(model, x) != before
    handle.remove()
    model[0].register_forward_pre_hook(lambda m, i: i)
    assert _key(model, x) != before


def test_a_swapped_hook_gives_the_loop_s_rows_without_the_check():
    import torch.nn.functional as F

    import pergrad_viz as pv

    torch.manual_seed(0)
    model = _net().double()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.tensor([0, 1, 2, 0, 1, 2])
    handle = model[0].register_forward_hook(lambda m, i, o: o)
    for _ in range(4):
        pv.per_sample_grads(model, F.cross_entropy, x, y)
    handle.remove()
    model[0].register_forward_hook(lambda m, i, o: o + 0.5 * o.mean(0, keepdim=True))
    got = pv.per_sample_grads(model, F.cross_entropy, x, y, verify=False)
    for n, p in model.named_parameters():
        want = torch.stack([torch.autograd.grad(F.cross_entropy(model(x[i:i + 1]), y[i:i + 1]), p)[0]
                            for i in range(6)])
        torch.testing.assert_close(got[n], want, rtol=1e-9, atol=1e-12)


def test_a_function_attribute_swapped_changes_the_key():
    """Found by a probe: ``self.f = lambda h: h`` swapped for a function centring over the batch kept the key (a
    callable was not read), and ``verify=False`` returned the old plan's rows, 0.23 off. A function attribute counts
    by its code (a builtin by itself); the same code made anew keeps the key."""
    model, x = _net(), torch.randn(3, 4)

    def same():
        return lambda h: h

    model[1].f, model[1].g = same(), torch.relu
    before = _key(model, x)
    model[1].f = same()
    assert _key(model, x) == before
    model[1].g = torch.tanh
    assert _key(model, x) != before
    model[1].g = torch.relu
    model[1].f = lambda h: h - h.mean(0)
    assert _key(model, x) != before


def test_tensors_and_arrays_held_in_containers_change_the_key_when_written():
    """Found by a probe: a coupling scaled by a tensor in a list or dict the module holds, a small numpy array or a
    tensor subclass kept the key when written (rows 0.23 off with ``verify=False``). They are read as the module's
    own tensor attributes are: a small one by its values, any other by its identity and version."""
    import numpy as np

    model, x = _net(), torch.randn(3, 4)
    holder = model[1]
    holder.scales, holder.named = [torch.tensor(0.0), 1.5], {"mix": torch.zeros(40)}
    holder.array, holder.marked = np.zeros(3), torch.zeros(2).as_subclass(_Marked)
    writes = [lambda: holder.scales[0].fill_(0.5), lambda: holder.named["mix"].add_(1.0),
              lambda: holder.array.__setitem__(0, 2.0), lambda: holder.marked.add_(1.0),
              lambda: holder.scales.__setitem__(0, torch.tensor(0.7))]
    for write in writes:
        before = _key(model, x)
        assert _key(model, x) == before
        with torch.no_grad():
            write()
        assert _key(model, x) != before


class _Marked(torch.Tensor):
    pass


def test_odd_tensors_held_give_a_stable_key():
    """Found by a review: a small buffer or frozen parameter of a ``__torch_dispatch__`` subclass (the kind DTensor,
    torchao and float8 use) made the key's ``tolist()`` raise on every call. Subclasses, nested and unreadable
    tensors count by identity and version; plain ones by their values or a digest of them."""
    from torch.testing._internal.two_tensor import TwoTensor

    model, x = _net(), torch.randn(3, 4)
    holder = model[1]
    holder.register_buffer("pair", TwoTensor(torch.zeros(3), torch.ones(3)))
    holder.frozen = nn.Parameter(TwoTensor(torch.zeros(2), torch.zeros(2)), requires_grad=False)
    holder.register_buffer("mask", torch.zeros(40, dtype=torch.bfloat16))
    holder.nested = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)], layout=torch.jagged)
    before = _key(model, x)
    assert _key(model, x) == before and hash(before) == hash(_key(model, x))
    with torch.no_grad():
        holder.mask.add_(1.0)
    assert _key(model, x) != before


def test_the_key_leaves_held_storage_resizable_and_sees_data_swapped():
    """Found by a review: the digest read the tensor through numpy, which pins its storage: a buffer of 17-4096
    numbers could no longer be resized after a call (as FSDP frees a frozen one). And a frozen tensor given other
    data (``p.data = new``, ``vector_to_parameters``) keeps its version: its digest is made again when its data's
    address moves too."""
    import functools

    model, x = _net(), torch.randn(3, 4)
    model[1].register_buffer("memory", torch.zeros(32))
    model[1].frozen = nn.Parameter(torch.zeros(64), requires_grad=False)
    model[1].act = functools.partial(torch.nn.functional.gelu, approximate="none")
    before = _key(model, x)
    model[1].memory.resize_(64)
    model[1].memory.resize_(32)
    model[1].frozen.data = torch.ones(64)
    assert _key(model, x) != before
    swapped = _key(model, x)
    torch.nn.utils.vector_to_parameters(torch.full((64,), 2.0), [model[1].frozen])
    assert _key(model, x) != swapped
    swapped = _key(model, x)
    model[1].act = functools.partial(torch.nn.functional.gelu, approximate="tanh")
    assert _key(model, x) != swapped
