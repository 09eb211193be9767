"""Whole-dataset scans (pergrad_viz.scan): values per example against references computed here, independently of
pergrad_viz (per-sample losses and gradients by a plain loop, helpers.ref_grads), sketches against an explicit
dense projection, resuming, refusals (fingerprints of the model and the loss), one process vs two under torchrun."""

from __future__ import annotations

import copy
import importlib
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import flatten_ref, ref_grads
from torch import nn
from zoo.forwards import BranchOnBatchSize
from zoo.nets import LastSeesPrevious

import pergrad_viz as pv
from pergrad_viz.bench.scans import format_table, throughput, torchrun_command
from pergrad_viz.scanning import store
from pergrad_viz.scanning.sketch import GradientSketch, allocate, layer_blocks
from pergrad_viz.tutorial import fashion_mnist
from pergrad_viz.tutorial.data import load_sample
from pergrad_viz.tutorial.networks import MLP, SmallCNN, load_model

scan_mod = importlib.import_module("pergrad_viz.scanning.api")  # the module (pv.scan is the function)
runner = importlib.import_module("pergrad_viz.scanning.runner")
remote = importlib.import_module("pergrad_viz.scanning.remote")
ALL = ("loss", "grad_norm", "layer_norms", "el2n")
REPO = Path(__file__).resolve().parents[2]


def _data(n: int = 48, seed: int = 0, flat: bool = False) -> torch.utils.data.TensorDataset:
    x, y = load_sample(n, flatten=flat)
    return torch.utils.data.TensorDataset(x, y)


def _model(kind: type = SmallCNN, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return kind().eval()


def _reference(model: nn.Module, loss_fn, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """(losses (N,), {name: (N, *shape)}) by the definition: each example alone, a plain loop."""
    losses = torch.stack([loss_fn(model(x[i:i + 1]), y[i:i + 1]).detach() for i in range(x.shape[0])])
    return losses, ref_grads(model, loss_fn, x, y)


def _layer_norms(ref: dict[str, torch.Tensor], modules: list[str]) -> torch.Tensor:
    """(N, L): per module, the norm of the gradients of the parameters it holds directly."""
    return torch.stack([torch.cat([ref[n].reshape(ref[n].shape[0], -1) for n in ref if n.rpartition(".")[0] == m],
                                  1).norm(dim=1) for m in modules], 1)


def _explicit_projection(sk: GradientSketch, names: list[str], shapes: dict[str, torch.Size]) -> torch.Tensor:
    """The (P, K) matrix of the sketch, built here from its seeded factors with torch.kron (rows in
    named_parameters() order): what the sketch must equal on materialised gradients."""
    rows = {}
    for bs, off, mats in zip(sk.blocks, sk.offsets, sk.matrices, strict=True):
        if bs.kind == "kronecker":
            r_out, r_in = mats
            out, inp, bias = bs.block.linear
            parts = [torch.kron(r_out, r_in[:inp])] + ([torch.kron(r_out, r_in[inp:inp + 1])] if bias else [])
        elif bs.kind == "dense":
            parts = [mats[0]]
        else:
            parts = [torch.eye(bs.block.size, dtype=sk.dtype)]
        m = torch.cat(parts)
        start = 0
        for name in bs.block.params:
            n = shapes[name].numel()
            rows[name] = (off, bs.dim, m[start:start + n])
            start += n
    dense = torch.zeros(sum(s.numel() for s in shapes.values()), sk.proj_dim, dtype=sk.dtype)
    offset = 0
    for name in names:
        off, dim, m = rows[name]
        dense[offset:offset + m.shape[0], off:off + dim] = m
        offset += m.shape[0]
    return dense


@pytest.mark.parametrize("kind", [MLP, SmallCNN])
def test_scan_values_match_references(tmp_path, kind):
    model, ds = _model(kind), _data(40)
    x, y = ds.tensors
    loss_fn = nn.CrossEntropyLoss()
    res = pv.scan(model, loss_fn, ds, quantities=ALL, proj_dim=24, batch_size=16, chunk_size=32, out=tmp_path / "s",
                  progress=False)
    assert list(res) == [*ALL, "projection"]
    losses, ref = _reference(model, loss_fn, x, y)
    flat = flatten_ref(ref, 1)
    torch.testing.assert_close(res["loss"], losses)
    torch.testing.assert_close(res["grad_norm"], flat.norm(dim=1), rtol=1e-5, atol=1e-6)
    modules = [b.module for b in layer_blocks(model)]
    assert res.layers == modules
    torch.testing.assert_close(res["layer_norms"], _layer_norms(ref, modules), rtol=1e-5, atol=1e-6)
    logits = torch.cat([model(x[i:i + 1]).detach() for i in range(x.shape[0])])
    el2n = (logits.softmax(1) - nn.functional.one_hot(y, 10)).norm(dim=1)
    torch.testing.assert_close(res["el2n"], el2n)
    sk = GradientSketch(model, 24, seed=0)
    names = [n for n, p in model.named_parameters()]
    dense = _explicit_projection(sk, names, {n: p.shape for n, p in model.named_parameters()})
    torch.testing.assert_close(sk.dense_matrix(), dense)
    torch.testing.assert_close(res["projection"], flat @ dense, rtol=1e-4, atol=1e-5)


def test_a_loss_reading_a_parameter_is_scanned_with_its_gradient(tmp_path):
    model, ds = _model(MLP), _data(20, flat=True)
    x, y = ds.tensors

    def loss_fn(out, t):  # a weight penalty inside the loss: part of every example's gradient
        return nn.functional.cross_entropy(out, t) + 0.05 * model.fc1.weight.square().sum()

    res = pv.scan(model, loss_fn, ds, quantities=("loss", "grad_norm"), batch_size=8, out=tmp_path / "s",
                  progress=False)
    losses, ref = _reference(model, loss_fn, x, y)
    torch.testing.assert_close(res["loss"], losses)
    torch.testing.assert_close(res["grad_norm"], flatten_ref(ref, 1).norm(dim=1), rtol=1e-5, atol=1e-6)


def test_a_coupling_found_by_the_check_hands_the_rest_of_the_scan_over(tmp_path):
    """A forward that doubles its hidden layer for batches of more than two: a coupling a probe of one and two
    samples misses, which the first batch's check finds; the later batches go on without hooks."""
    torch.manual_seed(0)
    model = BranchOnBatchSize()
    x, y = torch.randn(24, 4), torch.randint(0, 3, (24,))
    ds = torch.utils.data.TensorDataset(x, y)
    loss_fn = nn.CrossEntropyLoss()
    res = pv.scan(model, loss_fn, ds, quantities=("loss", "grad_norm"), batch_size=8, out=tmp_path / "s",
                  progress=False)
    losses, ref = _reference(model, loss_fn, x, y)
    torch.testing.assert_close(res["loss"], losses)
    torch.testing.assert_close(res["grad_norm"], flatten_ref(ref, 1).norm(dim=1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("detached", [False, True])
def test_a_coupling_of_one_row_found_by_the_check_of_every_row(tmp_path, detached):
    torch.manual_seed(0)
    model = LastSeesPrevious(4, detached).double()
    x, y = torch.randn(32, 4, dtype=torch.float64), torch.randint(0, 3, (32,))
    loss_fn = nn.CrossEntropyLoss()
    res = pv.scan(model, loss_fn, torch.utils.data.TensorDataset(x, y), quantities=("loss", "grad_norm"),
                  batch_size=16, out=tmp_path / "s", progress=False)
    losses, ref = _reference(model, loss_fn, x, y)
    torch.testing.assert_close(res["grad_norm"], flatten_ref(ref, 1).norm(dim=1), rtol=1e-9, atol=1e-12)


class _Tokens(nn.Module):
    """Embedding -> Linear on (B, T, d) -> Linear without bias, a frozen bias, GroupNorm: every kind of block."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(12, 6, padding_idx=0)
        self.mix = nn.Linear(6, 5)
        self.norm = nn.GroupNorm(1, 5)
        self.head = nn.Linear(5, 3, bias=False)
        self.out = nn.Linear(3, 3)
        self.out.bias.requires_grad_(False)

    def forward(self, idx):
        h = torch.tanh(self.mix(self.emb(idx)))  # (B, T, 5): the Linear sees T positions per sample
        h = self.norm(h.mean(1))
        return self.out(self.head(h))


class _Tied(nn.Module):
    """The output layer reuses the embedding's weight: the hooks pass cannot serve it (materialised instead)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(7, 4)
        self.fc = nn.Linear(4, 7)
        self.fc.weight = self.emb.weight

    def forward(self, idx):
        return self.fc(torch.relu(self.emb(idx).mean(1)))


class _ScaledTokens(nn.Module):
    """Embedding -> mean -> Linear, times a learnable 0-dim temperature (as CLIP's logit_scale)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(9, 4, padding_idx=1)
        self.fc = nn.Linear(4, 3)
        self.logit_scale = nn.Parameter(torch.tensor(0.5))

    def forward(self, idx):
        return self.fc(torch.tanh(self.emb(idx).mean(1))) * self.logit_scale.exp()


@pytest.mark.parametrize("kind", [_Tokens, _Tied, _ScaledTokens])
@pytest.mark.parametrize("proj_dim", [9, 30])
def test_token_models_match_references(tmp_path, kind, proj_dim):
    """Models with an nn.Embedding (padding, tokens repeated within a sample), tied weights, a 0-dim parameter:
    every quantity per example against the plain loop, the projection against the explicit dense matrix."""
    torch.manual_seed(1)
    model = kind()
    vocab = model.emb.num_embeddings
    idx, y = torch.randint(0, vocab, (20, 5)), torch.randint(0, 3, (20,))
    idx[3] = 2  # one token five times
    idx[4, :3] = model.emb.padding_idx if model.emb.padding_idx is not None else 0
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    res = pv.scan(model, loss_fn, torch.utils.data.TensorDataset(idx, y),
                  quantities=("loss", "grad_norm", "layer_norms"), proj_dim=proj_dim, seed=3, batch_size=8,
                  out=tmp_path / "s", progress=False)
    sk = GradientSketch(model, proj_dim, seed=3)
    assert sum(b.dim for b in sk.blocks) == proj_dim
    assert {b.kind for b in sk.blocks} >= ({"kronecker", "dense"} if kind is _Tokens else {"dense"})
    losses, ref = _reference(model, loss_fn, idx, y)
    flat = flatten_ref(ref, 1)  # (N, P), trainable parameters in named_parameters() order
    assert flat.norm(dim=1).min() > 0
    names = list(ref)
    shapes = {n: p.shape for n, p in model.named_parameters() if p.requires_grad}
    torch.testing.assert_close(res["loss"], losses)
    torch.testing.assert_close(res["grad_norm"], flat.norm(dim=1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(res["layer_norms"], _layer_norms(ref, [b.module for b in layer_blocks(model)]),
                               rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(res["projection"], flat @ _explicit_projection(sk, names, shapes), rtol=1e-4,
                               atol=1e-5)


def test_sketch_dot_products_estimate_gradient_dot_products():
    model, (x, y) = _model(MLP), _data(64, flat=True).tensors
    flat = flatten_ref(ref_grads(model, nn.CrossEntropyLoss(), x, y), 1)
    true = flat @ flat.T
    estimates = [GradientSketch(model, 2048, seed=s).project_grads(flat) for s in range(3)]
    for s in estimates:
        corr = torch.corrcoef(torch.stack([(s @ s.T).flatten(), true.flatten()]))[0, 1]
        assert corr > 0.85, corr  # kronecker factors are coarser than one dense (P, K) matrix: 0.94 measured
    mean = sum(s @ s.T for s in estimates) / len(estimates)  # unbiased: averaging seeds gets closer
    assert (mean - true).norm() < min(((s @ s.T) - true).norm() for s in estimates)


def test_allocation_is_exact_and_refuses_bad_sizes():
    blocks = layer_blocks(SmallCNN())
    for k in (4, 5, 17, 97, 128, 255, 256, 700):
        sketches = allocate(blocks, k)
        assert sum(b.dim for b in sketches) == k
        assert all(b.dim == b.k_out * b.k_in for b in sketches if b.kind == "kronecker")
    mlp = layer_blocks(MLP())
    for k in (2, 3, 101, 127, 256):  # only kronecker blocks: the last one takes an exact factor pair
        assert sum(b.dim for b in allocate(mlp, k)) == k
    with pytest.raises(ValueError, match="proj_dim=1 must lie between"):
        allocate(mlp, 1)
    with pytest.raises(ValueError, match="P=15910"):
        allocate(mlp, 20000)


def test_interrupted_scan_resumes_to_the_same_result(tmp_path, monkeypatch):
    model, ds = _model(), _data(72)
    kw = {"quantities": ALL, "proj_dim": 16, "batch_size": 8, "chunk_size": 16, "progress": False}
    want = pv.scan(model, nn.CrossEntropyLoss(), ds, out=tmp_path / "ref", **kw)
    seen: list[int] = []

    class Interrupted(Exception):
        pass

    mark_done = store.mark_done

    def stop_after_two(out, chunk: int) -> None:
        mark_done(out, chunk)
        seen.append(chunk)
        if len(seen) == 2:
            raise Interrupted("simulated interruption")

    monkeypatch.setattr(store, "mark_done", stop_after_two)
    monkeypatch.setattr(runner, "SYNC_SECONDS", 0.0)  # mark every chunk as soon as it is finished
    with pytest.raises(Interrupted):
        pv.scan(model, nn.CrossEntropyLoss(), ds, out=tmp_path / "s", **kw)
    with pytest.raises(ValueError, match="unfinished: 2 of 5 chunks done.*partial=True"):
        pv.load_scan(tmp_path / "s")
    part = pv.load_scan(tmp_path / "s", partial=True)
    assert torch.isnan(part["loss"][32:]).all() and not torch.isnan(part["loss"][:32]).any()

    seen.clear()
    monkeypatch.setattr(store, "mark_done", lambda out, chunk: mark_done(out, chunk) or seen.append(chunk))
    got = pv.scan(model, nn.CrossEntropyLoss(), ds, out=tmp_path / "s", **kw)
    assert seen == [2, 3, 4]  # only the missing chunks were computed
    for q in want:
        assert torch.equal(got[q], want[q]), q
    manifest = json.loads((tmp_path / "s" / "manifest.json").read_text())
    assert manifest["complete"] and manifest["chunks"]["done"] == [0, 1, 2, 3, 4]
    assert [r["examples"] for r in manifest["runs"]] == [72 - 32]  # the interrupted run recorded no run


def test_killed_mid_chunk_recomputes_that_chunk(tmp_path):
    model, ds = _model(MLP), _data(40, flat=True)
    kw = {"quantities": ("loss", "grad_norm"), "batch_size": 10, "chunk_size": 20, "progress": False}
    want = pv.scan(model, nn.CrossEntropyLoss(), ds, out=tmp_path / "s", **kw)
    want = {q: t.clone() for q, t in want.items()}
    # What a kill leaves: rows of a chunk half written, no marker, the manifest not updated.
    (tmp_path / "s" / "chunks" / "0000001.done").unlink()
    manifest = json.loads((tmp_path / "s" / "manifest.json").read_text())
    manifest["chunks"]["done"], manifest["complete"] = [0], False
    (tmp_path / "s" / "manifest.json").write_text(json.dumps(manifest))
    rows = np.load(tmp_path / "s" / "loss.npy", mmap_mode="r+")
    rows[20:30] = -1.0
    rows.flush()
    del rows
    got = pv.scan(model, nn.CrossEntropyLoss(), ds, out=tmp_path / "s", **kw)
    for q in want:
        assert torch.equal(got[q], want[q]), q


def test_rerun_with_other_model_data_or_settings_is_refused(tmp_path):
    model, ds = _model(MLP), _data(30, flat=True)
    out = tmp_path / "s"
    pv.scan(model, nn.CrossEntropyLoss(), ds, quantities=("loss",), batch_size=10, out=out, progress=False)
    before = (out / "loss.npy").read_bytes()
    pv.scan(model, nn.CrossEntropyLoss(), ds, quantities=("loss",), batch_size=10, out=out, progress=False)  # same
    other = _model(MLP, seed=1)
    flag = copy.deepcopy(model)
    flag.fc1.weight.requires_grad_(False)  # a probe: the refusal showed two hashes, not what had changed
    cases = [
        # a probe: the refusal showed hashes and internal field names; it says what they mean
        (other, ds, {"quantities": ("loss",)}, r"\(the model's parameters or buffers \(other values: another "
                                               r"checkpoint, seed or training; or other shapes: another width\) "
                                               r"changed\)"),
        (flag, ds, {"quantities": ("loss",)}, r"which of the model's parameters are trainable changed"),
        (model, _data(31, flat=True), {"quantities": ("loss",)}, r"the dataset \(other examples, split or limit\)"),
        (model, ds, {"quantities": ("loss", "el2n")}, r"settings\.quantities"),
        (model, ds, {"quantities": ("loss",), "chunk_size": 20}, r"settings\.chunk_size"),
    ]
    for m, d, kw, field in cases:
        fix = "pass a new out= directory, delete"
        with pytest.raises(scan_mod.ScanMismatchError, match=f"holds a different scan.*{field}.*{fix}"):
            pv.scan(m, nn.CrossEntropyLoss(), d, batch_size=10, out=out, progress=False, **kw)
    with pytest.raises(scan_mod.ScanMismatchError, match=r"settings\.loss"):
        pv.scan(model, nn.CrossEntropyLoss(reduction="sum"), ds, quantities=("loss",), batch_size=10, out=out,
                progress=False)
    assert (out / "loss.npy").read_bytes() == before  # nothing was written
    manifest = json.loads((out / "manifest.json").read_text())
    del manifest["fingerprint"]["model"]["parts"]  # a scan begun before the parts were kept goes on
    (out / "manifest.json").write_text(json.dumps(manifest))
    pv.scan(model, nn.CrossEntropyLoss(), ds, quantities=("loss",), batch_size=10, out=out, progress=False)


class _Masked(nn.Module):
    """A Linear whose output is multiplied by a non-persistent buffer (not in state_dict), and a Dropout."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(784, 10)
        self.drop = nn.Dropout(0.0)
        self.register_buffer("mask", torch.ones(10), persistent=False)

    def forward(self, x):
        return self.drop(self.fc(x)) * self.mask


def _ce(output, target):
    return nn.functional.cross_entropy(output, target)


def _scaled_ce(scale: float):
    return lambda output, target: scale * nn.functional.cross_entropy(output, target)


def test_fingerprint_covers_buffers_modes_and_the_loss(tmp_path):
    """What changes the results changes the fingerprint: a rerun after such a change is refused (nothing
    written), a rerun with the same settings continues."""
    torch.manual_seed(0)
    model, ds = _Masked().eval(), _data(20, flat=True)
    loss = lambda output, target: nn.functional.cross_entropy(output, target)  # noqa: E731
    out = tmp_path / "s"
    kw = {"quantities": ("loss", "grad_norm"), "batch_size": 10, "out": out, "progress": False}
    first = {q: t.clone() for q, t in pv.scan(model, loss, ds, **kw).items()}
    before = (out / "loss.npy").read_bytes()

    def refused(m, loss_fn, field):
        with pytest.raises(scan_mod.ScanMismatchError, match=f"holds a different scan.*{field}"):
            pv.scan(m, loss_fn, ds, **kw)
        assert (out / "loss.npy").read_bytes() == before

    model.mask[3] = 0.0  # a non-persistent buffer
    refused(model, loss, r"the model's parameters or buffers")
    model.mask[3] = 1.0
    model.drop.train()  # one module's training flag (p=0: the values would even agree)
    refused(model, loss, r"the model's training flags")
    model.drop.eval()
    other = lambda output, target: nn.functional.multi_margin_loss(output, target)  # noqa: E731
    refused(model, other, r"settings\.loss")  # two lambdas, one name
    refused(model, _scaled_ce(2.0), r"settings\.loss")
    refused(model, _ce, r"settings\.loss")
    again = pv.scan(model, lambda output, target: nn.functional.cross_entropy(output, target), ds, **kw)
    for q in first:
        assert torch.equal(again[q], first[q]), q
    assert len(again.manifest["runs"]) == 2  # the same settings: the directory was continued, not refused
    assert store.loss_description(_scaled_ce(2.0)) == store.loss_description(_scaled_ce(2.0))
    assert store.loss_description(_scaled_ce(2.0)) != store.loss_description(_scaled_ce(3.0))
    assert store.loss_description(nn.CrossEntropyLoss(weight=torch.ones(10))) != \
        store.loss_description(nn.CrossEntropyLoss(weight=torch.full((10,), 2.0)))


def test_loss_description_is_the_same_in_another_process():
    """Processes of one scan compare their manifests: the description may not depend on the process (string
    hashing is randomised per process, e.g. the order of a frozenset constant)."""
    code = ("import functools, torch; from torch import nn; from pergrad_viz import scan_store as s; "
            "f = lambda o, t: nn.functional.cross_entropy(o, t) if 'a' in {'a', 'b', 'c', 'd'} else 0; "
            "print(s.loss_description(f)); "
            "print(s.loss_description(functools.partial(nn.functional.cross_entropy, label_smoothing=0.1)))")
    outs = {subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")}
    assert len(outs) == 1 and "[code " in outs.pop()


class NeedsTwo(Exception):
    """An exception whose constructor takes two arguments: ``type(message)`` cannot rebuild it."""

    def __init__(self, path, why):
        super().__init__(f"{path}: {why}")
        self.path, self.why = path, why


def test_rank_zero_errors_reach_every_process(tmp_path, monkeypatch):
    """Under torch.distributed rank 0 prepares the directory: it re-raises its own exception (traceback kept),
    the other ranks raise the same exception (type, args, attributes; rank 0's traceback chained as the cause),
    or, for a type they cannot import, the same type from its message or a RuntimeError naming it."""
    model, ds = _model(MLP), _data(8, flat=True)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    sent = []
    monkeypatch.setattr(runner, "world", lambda: (0, 2))
    monkeypatch.setattr(runner, "gather", lambda obj, world: [obj] * world)
    monkeypatch.setattr(runner, "broadcast", lambda obj, world: sent.append(obj) or obj)
    with pytest.raises(FileExistsError, match="not empty") as info:
        pv.scan(model, nn.CrossEntropyLoss(), ds, out=foreign, progress=False)
    assert "_prepare" in {frame.name for frame in traceback.extract_tb(info.tb)}
    report = sent[0][0]
    assert report["qualname"] == "FileExistsError"

    monkeypatch.setattr(runner, "world", lambda: (1, 2))  # rank 1 hears of rank 0's failure
    monkeypatch.setattr(runner, "broadcast", lambda obj, world: (report, []))
    with pytest.raises(FileExistsError, match="not empty") as info:
        pv.scan(model, nn.CrossEntropyLoss(), ds, out=foreign, progress=False)
    assert isinstance(info.value.__cause__, remote.RemoteTraceback) and "_prepare" in str(info.value.__cause__)

    def create_arrays(out, arrays):
        raise NeedsTwo(out, "broken")

    monkeypatch.setattr(store, "create_arrays", create_arrays)
    monkeypatch.setattr(runner, "world", lambda: (0, 2))
    monkeypatch.setattr(runner, "broadcast", lambda obj, world: sent.append(obj) or obj)
    with pytest.raises(NeedsTwo) as info:
        pv.scan(model, nn.CrossEntropyLoss(), ds, out=tmp_path / "new", progress=False)
    assert "create_arrays" in {frame.name for frame in traceback.extract_tb(info.tb)}  # rank 0: the exception itself
    report = sent[-1][0]
    monkeypatch.setattr(runner, "world", lambda: (1, 2))
    monkeypatch.setattr(runner, "broadcast", lambda obj, world: (report, []))
    with pytest.raises(NeedsTwo) as info:
        pv.scan(model, nn.CrossEntropyLoss(), ds, out=tmp_path / "new", progress=False)
    assert (info.value.path, info.value.why) == (tmp_path / "new", "broken")
    assert str(info.value) == f"{tmp_path / 'new'}: broken" and "in create_arrays" in str(info.value.__cause__)

    class LocalNeedsTwo(Exception):  # defined in a function: no other process can import it
        def __init__(self, path, why):
            super().__init__(f"{path}: {why}")

    rebuilt = remote.rebuild_error(remote.error_report(LocalNeedsTwo("d", "broken")))
    assert type(rebuilt) is RuntimeError and "LocalNeedsTwo" in str(rebuilt) and "d: broken" in str(rebuilt)
    rebuilt = remote.rebuild_error({**remote.error_report(scan_mod.ScanMismatchError("other model")), "pickled": None})
    assert type(rebuilt) is scan_mod.ScanMismatchError and str(rebuilt) == "other model"


class FailsAt(torch.utils.data.Dataset):
    """(x, y) pairs of ``dataset``; item ``bad`` raises :class:`NeedsTwo`."""

    def __init__(self, dataset: torch.utils.data.Dataset, bad: int):
        self.dataset, self.bad = dataset, bad

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int):
        if i == self.bad:
            raise NeedsTwo(f"item {i}", "unreadable")
        return self.dataset[i]


@pytest.mark.parametrize("num_workers", [0, 1])
def test_errors_inside_a_scan_reach_the_user_as_themselves(tmp_path, num_workers):
    """An exception raised while scanning (in the loss, or loading a batch, in a DataLoader worker too) reaches
    the caller as itself, whatever its constructor takes: torch's DataLoader alone would raise a RuntimeError
    for a worker's NeedsTwo. A worker's traceback is chained as the cause."""
    model, ds = _model(MLP), _data(40, flat=True)
    assert 9 not in {round(k * 39 / 15) for k in range(16)}  # not one of the items the fingerprint reads
    with pytest.raises(NeedsTwo) as info:
        pv.scan(model, nn.CrossEntropyLoss(), FailsAt(ds, 9), batch_size=4, out=tmp_path / "data",
                num_workers=num_workers, progress=False)
    assert (info.value.path, info.value.why) == ("item 9", "unreadable")
    where = str(info.value.__cause__) if num_workers else "".join(traceback.format_tb(info.tb))
    assert "in __getitem__" in where

    def loss_fn(output, target):
        raise NeedsTwo("loss", "diverged")

    with pytest.raises(NeedsTwo) as info:
        pv.scan(model, loss_fn, ds, quantities="loss", batch_size=4, out=tmp_path / "loss", num_workers=num_workers,
                progress=False)
    assert info.value.why == "diverged" and "loss_fn" in {frame.name for frame in traceback.extract_tb(info.tb)}


def test_bad_inputs_get_clear_errors(tmp_path):
    model, ds = _model(MLP), _data(8, flat=True)
    loss_fn = nn.CrossEntropyLoss()
    with pytest.raises(FileNotFoundError, match="no scan at .*does not exist.*Run pv.scan"):
        pv.load_scan(tmp_path / "missing")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(FileNotFoundError, match="not a pergrad_viz scan.*no manifest.json"):
        pv.load_scan(foreign)
    with pytest.raises(FileExistsError, match="not empty.*Pass a new or empty directory"):
        pv.scan(model, loss_fn, ds, out=foreign, progress=False)
    (foreign / "manifest.json").write_text('{"format": "something else"}')
    with pytest.raises(ValueError, match="not a pergrad_viz scan manifest"):
        pv.load_scan(foreign)
    (foreign / "manifest.json").write_text("{not json")
    with pytest.raises(ValueError, match="damaged: delete"):
        pv.scan(model, loss_fn, ds, out=foreign, progress=False)
    with pytest.raises(NotADirectoryError, match="is a file"):
        pv.scan(model, loss_fn, ds, out=foreign / "notes.txt", progress=False)
    with pytest.raises(TypeError, match="not a DataLoader.*pass loader.dataset"):  # a probe: "an iterable dataset"
        pv.scan(model, loss_fn, torch.utils.data.DataLoader(ds, batch_size=4), out=tmp_path / "a", progress=False)
    with pytest.raises(TypeError, match=r"tuple of two tensors.*TensorDataset\(inputs, labels\)"):
        pv.scan(model, loss_fn, ds.tensors, out=tmp_path / "a", progress=False)
    no_labels = torch.utils.data.TensorDataset(ds.tensors[0])
    with pytest.raises(ValueError, match=r"not an \(input, label\) pair.*TensorDataset\(inputs, labels\)"):
        pv.scan(model, loss_fn, no_labels, out=tmp_path / "a", progress=False)
    with pytest.raises(ValueError, match="needs proj_dim"):
        pv.scan(model, loss_fn, ds, quantities=("projection",), out=tmp_path / "a", progress=False)
    with pytest.raises(ValueError, match="unknown quantities.*valid: loss"):
        pv.scan(model, loss_fn, ds, quantities=("los",), out=tmp_path / "a", progress=False)
    with pytest.raises(ValueError, match="multiple of batch_size"):
        pv.scan(model, loss_fn, ds, batch_size=4, chunk_size=6, out=tmp_path / "a", progress=False)
    with pytest.raises(ValueError, match="dataset is empty"):
        pv.scan(model, loss_fn, torch.utils.data.TensorDataset(torch.zeros(0, 784), torch.zeros(0)),
                out=tmp_path / "a", progress=False)
    with pytest.raises(ValueError, match="reduction='sum'"):
        pv.scan(model, nn.CrossEntropyLoss(reduction="none"), ds, out=tmp_path / "a", progress=False)
    regression = torch.utils.data.TensorDataset(ds.tensors[0], torch.randn(8, 10))
    with pytest.raises(ValueError, match="drop 'el2n'"):
        pv.scan(model, nn.MSELoss(), regression, quantities=("el2n",), out=tmp_path / "b", progress=False)
    dropout = nn.Sequential(nn.Linear(784, 4), nn.Dropout(0.5), nn.Linear(4, 10))
    with pytest.raises(pv.UnsupportedModelError, match="model.eval"):
        pv.scan(dropout, loss_fn, ds, out=tmp_path / "c", progress=False)
    assert not (tmp_path / "a").exists() and not (tmp_path / "c").exists()  # refused before writing


def test_model_left_as_found_and_results_are_copy_on_write(tmp_path):
    model, ds = _model(), _data(16)
    model.train()  # GroupNorm only: training mode is fine
    pv.scan(model, nn.CrossEntropyLoss(), ds, quantities=ALL, proj_dim=8, batch_size=8, out=tmp_path / "s",
            progress=False)
    assert model.training and all(p.grad is None for p in model.parameters())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    loaded = pv.load_scan(tmp_path / "s")
    assert loaded.complete and loaded["projection"].shape == (16, 8)
    loaded["loss"][:] = 0  # copy-on-write: the file is unchanged
    assert (pv.load_scan(tmp_path / "s")["loss"] > 0).all()


def test_fashion_mnist_dataset(tmp_path, capsys, monkeypatch):
    ds = fashion_mnist.fashion_mnist("test", limit=10, source=tmp_path)  # no Debian files there: the bundled sample
    err = capsys.readouterr().err
    assert "bundled sample" in err and "make data" in err
    x, y = ds[0]
    want_x, want_y = load_sample(10, train=False, flatten=False)
    assert len(ds) == 10 and x.shape == (1, 28, 28) and torch.equal(ds.tensors[0], want_x)
    assert torch.equal(ds.tensors[1], want_y)
    if not (fashion_mnist.DEBIAN_SOURCE / "t10k-images-idx3-ubyte.gz").is_file():
        pytest.skip("Debian's dataset-fashion-mnist is not installed (`make data`)")
    monkeypatch.setenv("PERGRAD_VIZ_CACHE", str(tmp_path / "cache"))
    full = fashion_mnist.fashion_mnist("test")
    assert len(full) == 10000 and torch.equal(full.tensors[0][:10], want_x)


def test_two_processes_under_torchrun_match_one(tmp_path):
    args = ["--data", "fashion-mnist-sample", "--model", "mlp", "--limit", "90", "--batch-size", "15",
            "--chunk-size", "15", "--quantities", "loss,grad_norm,layer_norms,el2n", "--proj-dim", "32",
            "--threads", "1", "--device", "cpu", "--no-progress"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(torchrun_command(2, [*args, "--out", str(tmp_path / "two")]), cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "with 2 process(es)" in proc.stdout
    two = pv.load_scan(tmp_path / "two")
    assert two.manifest["runs"][-1]["world_size"] == 2
    model = load_model("mlp", None)
    ds = fashion_mnist.fashion_mnist("train", limit=90, source=None)
    one = pv.scan(model, nn.CrossEntropyLoss(), ds, quantities=ALL, proj_dim=32, batch_size=15, chunk_size=15,
                  out=tmp_path / "one", progress=False)
    assert two.manifest["fingerprint"] == one.manifest["fingerprint"]
    for q in one:
        torch.testing.assert_close(two[q], one[q], rtol=0, atol=1e-6)


def test_cli_scan_in_process_and_bench_table(tmp_path, capsys):
    from pergrad_viz.cli.main import main

    ckpt = tmp_path / "cnn.pt"
    torch.save(_model(SmallCNN, seed=5).state_dict(), ckpt)
    assert main(["scan", "--data", "fashion-mnist-sample", "--model", "cnn", "--checkpoint", str(ckpt), "--limit",
                 "20", "--split", "test", "--batch-size", "10", "--quantities", "loss,el2n", "--out",
                 str(tmp_path / "s"), "--no-progress", "--device", "cpu"]) == 0
    assert "scanned 20 of 20 examples" in capsys.readouterr().out
    assert main(["scan", "--data", "fashion-mnist-sample", "--model", "cnn", "--limit", "20", "--split", "test",
                 "--batch-size", "10", "--quantities", "loss", "--out", str(tmp_path / "s"), "--no-progress",
                 "--device", "cpu"]) == 2  # another model (seeded, no checkpoint) and quantities: refused
    err = capsys.readouterr().err
    assert "error:" in err and "holds a different scan" in err and "pass a new --out directory" in err
    assert "sha256" not in err and "the model's parameters or buffers" in err
    res = pv.load_scan(tmp_path / "s")
    x, y = load_sample(20, train=False, flatten=False)
    logits = _model(SmallCNN, seed=5)(x).detach()
    torch.testing.assert_close(res["loss"], nn.functional.cross_entropy(logits, y, reduction="none"))
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        records = throughput("mlp", n=64, batch_size=32, proj_dim=16, processes=(1,), rounds=1,
                             data="fashion-mnist-sample")
        assert torch.get_num_threads() == 3  # found by a probe: left at the bench's 1
    finally:
        torch.set_num_threads(threads)
    table = format_table(records)
    assert [r["method"] for r in records] == ["forward+backward", "scan: losses only", "scan: grad norms",
                                              "scan: + projection"]
    assert "examples/s" in table and "scan: + projection 16" in table
    assert torchrun_command(2, ["--out", "d"])[:3] == [sys.executable, "-m", "torch.distributed.run"]


class _BatchCentred(nn.Module):
    """Its samples interact (a batch mean): each example's loss alone differs from its loss in the batch."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(5, 3)

    def forward(self, x):
        h = self.fc(x)
        return h - 0.5 * h.mean(0, keepdim=True)


@pytest.mark.parametrize("quantities", [("loss", "el2n"), ("loss", "grad_norm", "el2n")])
def test_a_model_whose_samples_interact_is_scanned_example_by_example(tmp_path, quantities):
    model = _BatchCentred().double()
    x, y = torch.randn(4, 5, dtype=torch.float64), torch.tensor([0, 1, 2, 1])
    loss_fn = nn.CrossEntropyLoss()
    res = pv.scan(model, loss_fn, torch.utils.data.TensorDataset(x, y), quantities=quantities, batch_size=2,
                  out=tmp_path / "s", progress=False)
    with torch.no_grad():
        want_loss = torch.stack([loss_fn(model(x[i:i + 1]), y[i:i + 1]) for i in range(4)])
        p = torch.softmax(torch.cat([model(x[i:i + 1]) for i in range(4)]), 1)
    p[torch.arange(4), y] -= 1
    torch.testing.assert_close(torch.as_tensor(res["loss"]), want_loss)
    torch.testing.assert_close(torch.as_tensor(res["el2n"]), p.norm(dim=1))
    if "grad_norm" in quantities:
        params = list(model.parameters())
        want = torch.stack([torch.cat([g.reshape(-1) for g in torch.autograd.grad(
            loss_fn(model(x[i:i + 1]), y[i:i + 1]), params)]).norm() for i in range(4)])
        torch.testing.assert_close(torch.as_tensor(res["grad_norm"]), want)


def test_processes_with_different_batch_sizes_are_refused_naming_it(tmp_path, monkeypatch):
    """Found by a probe of the multi-process scan: batches of 8 and 4 on two processes were accepted, their rows not
    bit for bit one process's, the manifest naming rank 0's size alone."""
    model, ds = _model(MLP), _data(8, flat=True)
    seen = {}

    class Stop(Exception):
        pass

    def noted(obj, world):  # what each process would send, by its batch size
        seen[len(seen)] = obj
        raise Stop

    monkeypatch.setattr(runner, "world", lambda: (0, 2))
    monkeypatch.setattr(runner, "gather", noted)
    for batch in (8, 4):
        with pytest.raises(Stop):
            pv.scan(model, nn.CrossEntropyLoss(), ds, out=tmp_path / "scan", batch_size=batch, chunk_size=8,
                    progress=False)
    monkeypatch.setattr(runner, "gather", lambda obj, world: [seen[0], seen[1]])
    monkeypatch.setattr(runner, "broadcast", lambda obj, world: obj)
    with pytest.raises(ValueError, match="differ in batch_size"):
        pv.scan(model, nn.CrossEntropyLoss(), ds, out=tmp_path / "scan", batch_size=8, chunk_size=8, progress=False)


class _Tokens(nn.Module):
    """Next-token logits (B, T, V) of (B, T) ids: not the class logits el2n needs."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(7, 4), nn.Linear(4, 7)

    def forward(self, ids):
        return self.head(self.emb(ids))


def test_a_quantity_refused_at_the_first_batch_leaves_no_scan_behind(tmp_path):
    """Found by a probe: el2n of a sequence model was refused after the manifest and arrays were written, so the
    message's own fix (drop 'el2n', same out=) met 'holds a different scan'."""
    torch.manual_seed(0)
    ids = torch.randint(0, 7, (8, 3))
    ds = torch.utils.data.TensorDataset(ids, ids)

    def token_loss(out, target):
        return nn.functional.cross_entropy(out.flatten(0, 1), target.flatten(), reduction="sum")

    out = tmp_path / "scan"
    with pytest.raises(ValueError, match="drop 'el2n'"):
        pv.scan(_Tokens(), token_loss, ds, quantities=("loss", "el2n"), batch_size=4, out=out, progress=False)
    assert not out.exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError):  # a directory holding files of its own: refused, untouched
        pv.scan(_Tokens(), token_loss, ds, quantities=("loss", "el2n"), batch_size=4, out=kept, progress=False)
    result = pv.scan(_Tokens(), token_loss, ds, quantities=("loss",), batch_size=4, out=out, progress=False)
    assert result["loss"].shape == (8,) and (kept / "notes.txt").read_text() == "mine"


def test_resuming_with_another_batch_size_names_it(tmp_path):
    """Found by a probe: a resume with only batch_size changed was refused over chunk_size, which was never passed."""
    model, ds = _model(MLP), _data(40, flat=True)
    pv.scan(model, nn.CrossEntropyLoss(), ds, quantities="loss", batch_size=4, out=tmp_path / "s", progress=False)
    with pytest.raises(pv.ScanMismatchError, match=r"settings\.chunk_size.*pass the batch_size the scan began with"):
        pv.scan(model, nn.CrossEntropyLoss(), ds, quantities="loss", batch_size=5, out=tmp_path / "s", progress=False)


def test_an_error_on_one_process_mid_scan_reaches_the_others(tmp_path, monkeypatch):
    """Found by a probe: a model error on rank 1 mid-scan left rank 0 waiting at the end-of-scan barrier until the
    process group's timeout (30 min by default), then a raw gloo error. Every process now hands its outcome over
    with its row counts: the failing one its error (then raises it), the others raise that error as itself."""
    model, ds = _model(MLP), _data(8, flat=True)
    monkeypatch.setattr(runner, "barrier", lambda world: None)
    monkeypatch.setattr(runner, "broadcast", lambda obj, world: obj)
    told = []
    report = remote.error_report(NeedsTwo("item 5", "diverged"))

    def gather(obj, world):  # rank 0's view: the other process failed mid-scan
        told.append(obj)
        return [obj, (0.0, 0, report)] if isinstance(obj, tuple) and len(obj) == 3 else [obj] * world

    monkeypatch.setattr(runner, "gather", gather)
    monkeypatch.setattr(runner, "world", lambda: (0, 2))
    with pytest.raises(NeedsTwo) as info:
        pv.scan(model, nn.CrossEntropyLoss(), ds, out=tmp_path / "s", batch_size=4, progress=False)
    assert info.value.why == "diverged" and isinstance(info.value.__cause__, remote.RemoteTraceback)
    assert told[-1][2] is None  # rank 0's own part went fine

    def loss_fn(output, target):
        raise NeedsTwo("loss", "nan")

    monkeypatch.setattr(runner, "gather", lambda obj, world: told.append(obj) or [obj] * world)  # it fails itself
    with pytest.raises(NeedsTwo) as info:
        pv.scan(model, loss_fn, ds, quantities="loss", out=tmp_path / "t", batch_size=4, progress=False)
    assert info.value.why == "nan" and told[-1][2]["qualname"] == "NeedsTwo"


def test_a_scan_refused_on_one_process_before_the_first_exchange_reaches_the_others(tmp_path, monkeypatch):
    """Found by a probe: Dropout in training mode on rank 1 alone was refused there while rank 0 waited in the first
    exchange until the process group's timeout. The refused process joins the exchange marked as failed."""
    model, ds = _model(MLP), _data(8, flat=True)
    told, sent = [], []
    monkeypatch.setattr(runner, "world", lambda: (1, 2))  # rank 1, in training mode: refused, tells the others
    monkeypatch.setattr(runner, "gather", lambda obj, world: told.append(obj) or [obj] * world)
    monkeypatch.setattr(runner, "broadcast", lambda obj, world: sent.append(obj) or obj)
    dropout = nn.Sequential(model, nn.Dropout(0.5)).train()
    with pytest.raises(pv.UndefinedPerSampleError, match="Dropout"):
        pv.scan(dropout, nn.CrossEntropyLoss(), ds, out=tmp_path / "s", progress=False)
    assert set(told[-1]) == {"error"} and told[-1]["error"]["qualname"] == "UndefinedPerSampleError"
    report = told[-1]["error"]

    monkeypatch.setattr(runner, "world", lambda: (0, 2))  # rank 0, fine itself, hears of it in the exchange
    monkeypatch.setattr(runner, "gather", lambda obj, world: [obj, {"error": report}])
    with pytest.raises(pv.UndefinedPerSampleError, match="Dropout") as info:
        pv.scan(model.eval(), nn.CrossEntropyLoss(), ds, out=tmp_path / "t", progress=False)
    assert isinstance(info.value.__cause__, remote.RemoteTraceback)
    assert sent[-1][0]["qualname"] == "UndefinedPerSampleError"  # and told the other processes
    assert not (tmp_path / "t").exists()  # refused before rank 0 prepared anything


def test_a_mixing_output_selection_is_scanned_example_by_example(tmp_path):
    """Found by a probe: a scan's output= that mixes the examples of a batch (5 * o / o.norm()) gave its loss and
    EL2N columns from the whole batch (0.072 for 0.012); the probe now sees the selection."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).eval()
    x, y = torch.randn(12, 4), torch.randint(0, 3, (12,))
    select, ce = (lambda o: 5 * o / o.norm()), nn.CrossEntropyLoss()
    got = pv.scan(model, ce, torch.utils.data.TensorDataset(x, y), quantities=("loss", "el2n"), batch_size=4,
                  out=tmp_path / "scan", progress=False, output=select)
    with torch.no_grad():
        outs = [select(model(x[i:i + 1])) for i in range(12)]
    want = torch.stack([ce(o, y[i:i + 1]) for i, o in enumerate(outs)])
    torch.testing.assert_close(torch.as_tensor(got["loss"]), want)
    el2n = torch.stack([(o.softmax(-1) - nn.functional.one_hot(y[i:i + 1], 3)).norm() for i, o in enumerate(outs)])
    torch.testing.assert_close(torch.as_tensor(got["el2n"]), el2n)


def test_a_scan_shows_its_shapes_and_names_its_quantities(tmp_path):
    """Found by a newcomer's probe: printing a scan printed every number, and a missing quantity a bare KeyError."""
    from pergrad_viz.tutorial import fashion_mnist
    from pergrad_viz.tutorial.networks import MLP

    torch.manual_seed(0)
    pv.scan(MLP(784, 20, 10).eval(), nn.CrossEntropyLoss(), fashion_mnist.fashion_mnist("train", limit=8),
            out=tmp_path / "s", progress=False)
    result = pv.load_scan(tmp_path / "s")
    assert repr(result) == "Scan({'loss': (8,) float32, 'grad_norm': (8,) float32}, complete=True)"
    with pytest.raises(KeyError, match="'el2n' is not in this scan: it holds 'loss', 'grad_norm'"):
        result["el2n"]
    assert result.get("el2n") is None


def test_scan_bench_makes_each_methods_first_call_outside_its_rounds(monkeypatch):
    """Found by a probe: with --rounds 1 the one timed scan paid the first call's plan and imports (205 ms against
    8 ms at 3 rounds). Each method now scans one batch first, untimed."""
    from pergrad_viz.bench import scans as bench_scans

    sizes = []
    real = bench_scans.scan

    def recording(model, loss_fn, dataset, **kwargs):
        sizes.append(len(dataset))
        return real(model, loss_fn, dataset, **kwargs)

    monkeypatch.setattr(bench_scans, "scan", recording)
    bench_scans.throughput("mlp", n=64, batch_size=16, proj_dim=8, processes=(1,), rounds=1,
                           data="fashion-mnist-sample")
    methods = len(bench_scans.METHODS)
    assert sizes == [16] * methods + [64] * methods
