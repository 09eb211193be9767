"""The nn.MultiheadAttention capturing forward and call rule (pergrad_viz.rules.attention), called directly: the
capture gives the layer's own outputs, and the rule, fed the gradients of the captured internals, equals a loop
over the samples (each a batch of one, torch.autograd.grad with that sample's rows of the output gradients), in
float64, for N = 1 and N = 3 output gradients per sample; end to end through the hooks strategy; and a capture
that differs from the layer's forward is caught (the layer takes the per-layer fallback)."""

from __future__ import annotations

import pytest
import torch
from helpers import empty_out, ref_grads
from torch import nn

import pergrad_viz as pv
from pergrad_viz.core.trainable import Trainable
from pergrad_viz.rules import call_rule_for
from pergrad_viz.rules.attention import bind, capture_attention, multihead_attention
from pergrad_viz.strategies import hooks

TOL = {"rtol": 1e-10, "atol": 1e-12}
DT = torch.float64
B, L, S, E, H = 3, 4, 5, 6, 2

# name: (module kwargs, call kwargs (masks by name), cross attention, frozen parameter names)
CASES = {
    "self batch_first": ({"batch_first": True}, {}, False, ()),
    "self seq first": ({}, {}, False, ()),
    "self no bias": ({"bias": False, "batch_first": True}, {"need_weights": False}, False, ()),
    "self no weights": ({"batch_first": True}, {"need_weights": False}, False, ()),
    "self per-head weights": ({}, {"average_attn_weights": False}, False, ()),
    "cross packed": ({}, {}, True, ()),
    "cross kdim vdim batch_first": ({"kdim": 5, "vdim": 7, "batch_first": True}, {}, True, ()),
    "cross kdim vdim no bias": ({"kdim": 5, "vdim": 7, "bias": False}, {"need_weights": False}, True, ()),
    "mask 2d bool": ({"batch_first": True}, {"attn_mask": "2d bool"}, False, ()),
    "mask 2d float": ({}, {"attn_mask": "2d float", "need_weights": False}, True, ()),
    "mask 3d float": ({"batch_first": True}, {"attn_mask": "3d float"}, False, ()),
    "mask 3d bool no weights": ({}, {"attn_mask": "3d bool", "need_weights": False}, True, ()),
    "padding bool": ({"batch_first": True}, {"key_padding_mask": "bool"}, True, ()),
    "padding float no weights": ({}, {"key_padding_mask": "float", "need_weights": False}, False, ()),
    "padding and mask": ({"batch_first": True}, {"key_padding_mask": "bool", "attn_mask": "2d bool",
                                                 "average_attn_weights": False}, False, ()),
    "causal sdpa": ({"batch_first": True}, {"attn_mask": "causal", "is_causal": True, "need_weights": False},
                    False, ()),
    "causal hint over another mask": ({}, {"attn_mask": "2d float", "is_causal": True, "need_weights": False},
                                      False, ()),
    "causal with weights": ({"batch_first": True}, {"attn_mask": "causal", "is_causal": True}, False, ()),
    "causal with padding": ({}, {"attn_mask": "causal", "is_causal": True, "key_padding_mask": "float",
                                 "need_weights": False}, False, ()),
    "bias_kv": ({"add_bias_kv": True, "batch_first": True}, {}, False, ()),
    "zero_attn": ({"add_zero_attn": True}, {"need_weights": False}, True, ()),
    "bias_kv zero_attn masks": ({"add_bias_kv": True, "add_zero_attn": True, "kdim": 5, "vdim": 7},
                                {"attn_mask": "3d bool", "key_padding_mask": "bool",
                                 "average_attn_weights": False}, True, ()),
    "bias_kv causal sdpa": ({"add_bias_kv": True, "add_zero_attn": True, "batch_first": True},
                            {"attn_mask": "causal", "is_causal": True, "need_weights": False}, False, ()),
    "fully padded sample": ({"batch_first": True}, {"key_padding_mask": "all of sample 1", "need_weights": False},
                            False, ()),
    "frozen in_proj": ({"add_bias_kv": True}, {}, False, ("in_proj_weight", "out_proj.bias")),
    "only out_proj": ({"kdim": 5, "vdim": 7}, {}, True,
                      ("q_proj_weight", "k_proj_weight", "v_proj_weight", "in_proj_bias")),
}

def make_mask(kind: str, length: int, source: int, gen: torch.Generator) -> torch.Tensor:
    """A mask of the given kind; bool ones leave key 0 of every row free (no row with every key masked)."""
    if kind == "causal":
        return nn.Transformer.generate_square_subsequent_mask(length, dtype=DT)[:, :source]
    if kind == "all of sample 1":
        mask = torch.zeros(B, source, dtype=torch.bool)
        mask[1] = True
        return mask
    shape = {"2d": (length, source), "3d": (B * H, length, source), "bool": (B, source), "float": (B, source)}
    dims = shape[kind.split()[0]]
    if kind.endswith("bool"):
        mask = torch.rand(dims, generator=gen) < 0.4
        mask[..., 0] = False
        return mask
    return torch.randn(dims, generator=gen, dtype=DT)


def setup(name: str, gen: torch.Generator):
    module_kw, call_kw, cross, frozen = CASES[name]
    torch.manual_seed(0)
    module = nn.MultiheadAttention(E, H, **module_kw, dtype=DT).eval()
    with torch.no_grad():
        for p in module.parameters():  # biases (bias_k, bias_v, in_proj_bias) start at zero: make them count
            p.copy_(torch.randn(p.shape, generator=gen, dtype=DT) * 0.5)
    for p_name in frozen:
        module.get_parameter(p_name).requires_grad_(False)
    source = S if cross else L
    first = (lambda t, b: (b, t)) if module.batch_first else (lambda t, b: (t, b))
    query = torch.randn(*first(L, B), E, generator=gen, dtype=DT)
    if cross:
        key = torch.randn(*first(S, B), module.kdim, generator=gen, dtype=DT)
        value = torch.randn(*first(S, B), module.vdim, generator=gen, dtype=DT)
    else:
        key = value = query
    kw = {k: make_mask(v, L, source, gen) if isinstance(v, str) else v for k, v in call_kw.items()}
    return module, (query, key, value), kw


def sample(t: torch.Tensor, b: int, dim: int) -> torch.Tensor:
    return t.narrow(dim, b, 1)


def reference(module: nn.Module, args: tuple, kwargs: dict, grads: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """{name: (N, B, *shape)}: sample b alone (a batch of one) through the layer, one backward per gradient row."""
    named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    seq_dim = 0 if module.batch_first else 1
    n = grads[0].shape[0]
    result = {name: torch.empty(n, B, *p.shape, dtype=DT) for name, p in named}
    for b in range(B):
        kw = dict(kwargs)
        if kw.get("key_padding_mask") is not None:
            kw["key_padding_mask"] = sample(kw["key_padding_mask"], b, 0)
        mask = kw.get("attn_mask")
        if mask is not None and mask.dim() == 3:
            kw["attn_mask"] = mask[b * H:(b + 1) * H]
        query, key, value = (sample(t, b, seq_dim) for t in args)
        outs = [t for t in module(query, key, value, **kw) if t is not None]
        used = [k for k, t in enumerate(outs) if t.requires_grad]  # the weights do not depend on out_proj
        for r in range(n):
            rows = [sample(grads[0][r], b, seq_dim)] + [sample(g[r], b, 0) for g in grads[1:]]
            rows, outs_r = [rows[k] for k in used], [outs[k] for k in used]
            got = torch.autograd.grad(outs_r, [p for _, p in named], rows, retain_graph=True, allow_unused=True)
            for (name, p), gp in zip(named, got, strict=True):
                result[name][r, b] = torch.zeros_like(p) if gp is None else gp
    return result


def captured_gradients(outputs: list[torch.Tensor], internals: list[torch.Tensor], grads: list[torch.Tensor]
                       ) -> list[torch.Tensor | None]:
    """(N, *internal.shape) gradients of the internals, row r from the outputs' gradient rows r."""
    need = [k for k, t in enumerate(internals) if t.requires_grad]
    if not need:
        return [None] * len(internals)
    rows = [torch.autograd.grad(outputs, [internals[k] for k in need], [g[r] for g in grads], retain_graph=True,
                                allow_unused=True) for r in range(grads[0].shape[0])]
    result: list[torch.Tensor | None] = [None] * len(internals)
    for pos, k in enumerate(need):
        if rows[0][pos] is not None:
            result[k] = torch.stack([row[pos] for row in rows])
    return result


@pytest.mark.parametrize("given", [True, False], ids=["arguments as given", "all arguments"])
@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("name", list(CASES))
def test_attention_rule(name: str, n: int, given: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    module, args, kwargs = setup(name, gen)
    assert call_rule_for(module) is multihead_attention
    want_outputs = [t for t in module(*args, **kwargs) if t is not None]

    got, captured = capture_attention(module, args, kwargs)  # the capturing forward is the layer's
    outputs = [t for t in got if t is not None]
    assert len(outputs) == len(want_outputs)
    for g, w in zip(outputs, want_outputs, strict=True):
        torch.testing.assert_close(g, w, **TOL)
    assert captured.state.packed == (args[0] is args[1] and module.bias_k is None and not module.add_zero_attn)

    grads = [torch.randn(n, *t.shape, generator=gen, dtype=DT) for t in outputs]
    inner = captured_gradients(outputs, captured.internals, grads)
    out = empty_out(module, n, B)
    inputs = args if given else bind(module, args, kwargs)
    multihead_attention(module, inputs, grads, out, captured, inner)
    want = reference(module, args, kwargs, grads)
    assert set(out) == set(want)
    for p_name, w in want.items():
        assert not w.isnan().any(), p_name
        torch.testing.assert_close(out[p_name], w, **TOL, msg=lambda m, p_name=p_name: f"{p_name}: {m}")


def test_supports_every_configuration() -> None:
    for kw in ({}, {"batch_first": True, "bias": False}, {"kdim": 3, "vdim": 5}, {"add_bias_kv": True},
               {"add_zero_attn": True}):
        assert call_rule_for(nn.MultiheadAttention(E, H, **kw)) is multihead_attention


def test_uncaptured_calls_go_to_the_fallback() -> None:
    """Unbatched input, and a call the capturing forward did not run, are not the rule's: NotImplementedError."""
    module = nn.MultiheadAttention(E, H).eval()
    x = torch.randn(L, E)
    assert capture_attention(module, (x, x, x), {}) is None
    with pytest.raises(NotImplementedError):
        multihead_attention(module, (x, x, x), [torch.zeros(1, L, E)], {"out_proj.bias": torch.empty(1, 1, E)})


class Encoder(nn.Module):
    """A TransformerEncoderLayer over (B, T, 8) tokens, mean over tokens, a Linear head."""

    def __init__(self, causal: bool = False):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16, dropout=0.0,
                                                batch_first=True)
        self.head = nn.Linear(8, 3)
        self.causal = causal

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], dtype=x.dtype) if self.causal else None
        return self.head(self.layer(x, src_mask=mask, is_causal=self.causal).mean(1))


@pytest.mark.parametrize("causal", [False, True])
def test_transformer_end_to_end(causal: bool) -> None:
    torch.manual_seed(0)
    model = Encoder(causal).to(DT).eval()
    x = torch.randn(5, 6, 8, dtype=DT)
    y = torch.randint(0, 3, (5,))
    assert hooks.describe(Trainable.of(model), x)["layer.self_attn"] == "call"
    got = pv.per_sample_grads(model, nn.CrossEntropyLoss(), x, y, strategy="hooks")
    want = ref_grads(model, nn.CrossEntropyLoss(), x, y)
    assert list(got) == list(want)
    for p_name, w in want.items():
        torch.testing.assert_close(got[p_name], w, **TOL, msg=lambda m, p_name=p_name: f"{p_name}: {m}")


def test_a_capture_unlike_the_layer_is_caught(monkeypatch) -> None:
    """A capturing forward whose outputs differ from the layer's (a bug in it) is found on its first call: the
    layer takes the per-layer fallback, and the result still equals the loop."""
    from pergrad_viz.rules import attention

    def wrong(module, args, kwargs):
        (out, weights), captured = capture_attention(module, args, kwargs)
        return (out * 1.01, weights), captured

    monkeypatch.setattr(attention.multihead_attention, "capture", wrong)
    torch.manual_seed(0)
    model = Encoder().to(DT).eval()
    x = torch.randn(5, 6, 8, dtype=DT)
    y = torch.randint(0, 3, (5,))
    got = pv.per_sample_grads(model, nn.CrossEntropyLoss(), x, y, strategy="hooks")
    assert hooks.describe(Trainable.of(model), x)["layer.self_attn"] == "fallback"
    assert "forward" not in vars(model.layer.self_attn)
    want = ref_grads(model, nn.CrossEntropyLoss(), x, y)
    for p_name, w in want.items():
        torch.testing.assert_close(got[p_name], w, **TOL, msg=lambda m, p_name=p_name: f"{p_name}: {m}")


class FailsAfterAttention(Encoder):
    """Raises on its second forward, after the attention ran (the probe's runs pass)."""

    calls = 0

    def forward(self, x):
        out = super().forward(x)
        FailsAfterAttention.calls += 1
        if FailsAfterAttention.calls > 3:  # the probe runs the model three times
            raise RuntimeError("boom after the attention")
        return out


def test_a_failing_forward_leaves_no_capturing_forward_behind() -> None:
    torch.manual_seed(0)
    model = FailsAfterAttention().to(DT).eval()
    x = torch.randn(5, 6, 8, dtype=DT)
    y = torch.randint(0, 3, (5,))
    with pytest.raises(RuntimeError, match="boom after the attention"):
        pv.per_sample_grads(model, nn.CrossEntropyLoss(), x, y, strategy="hooks")
    assert all("forward" not in vars(m) for m in model.modules())


def test_bind_fills_arguments_as_inspect_does_and_refuses_what_it_refuses() -> None:
    import inspect

    module = nn.MultiheadAttention(E, H)
    q, mask = torch.zeros(L, B, E), torch.zeros(L, L)
    signature = inspect.signature(nn.MultiheadAttention.forward)

    def by_inspect(args, kwargs):
        bound = signature.bind(module, *args, **kwargs)
        bound.apply_defaults()
        return tuple(bound.arguments.values())[1:]

    for args, kwargs in [((q, q, q), {}), ((q, q, q, None, False), {}), ((q,), {"key": q, "value": q}),
                         ((q, q, q), {"attn_mask": mask, "need_weights": False, "is_causal": True}),
                         ((q, q, q, None, True, mask, False, True), {})]:
        got, want = bind(module, args, kwargs), by_inspect(args, kwargs)
        assert len(got) == len(want) == 8 and all(a is b for a, b in zip(got, want, strict=True))
    for args, kwargs in [((q, q), {}), ((q, q, q), {"query": q}), ((q, q, q), {"mask": mask}),
                         ((q,) * 9, {})]:
        with pytest.raises(TypeError):
            bind(module, args, kwargs)
