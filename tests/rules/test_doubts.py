"""rules.doubts: the criterion on Gram maxima (tops_fit) and the one read for all layers (Doubts.settle), with notes
of several dtypes (under autocast a float32 input meets a float16 gradient). The end-to-end path (norms and clipped
sums against a loop) is tests/derived/test_deferred_ranges.py."""

from __future__ import annotations

import torch

from pergrad_viz.rules import doubts

F32, F16 = torch.float32, torch.float16


def test_tops_fit_reads_each_gram_in_its_own_dtype():
    assert doubts.tops_fit([1.0, 4.0], [2.0, 0.5], (F32, F32), 16, 8, 8)
    assert doubts.tops_fit([1.0, 0.0], [2.0, 0.0], (F32, F32), 16, 8, 8)  # a zero sample: nothing lost
    assert not doubts.tops_fit([1.0, float("inf")], [2.0, 0.5], (F32, F32), 16, 8, 8)  # a square overflowed
    assert not doubts.tops_fit([1e30, 1.0], [1e10, 1.0], (F32, F32), 16, 8, 8)  # the sum would overflow
    assert not doubts.tops_fit([1e-10], [1e37], (F32, F32), 16, 8, 8)  # a bias's sum of the right Gram alone
    assert not doubts.tops_fit([1.0, 1e-40], [1.0, 1.0], (F32, F32), 16, 8, 8)  # float32's underflow
    # 1e-6 is far above float32's underflow and below float16's (its squares lose digits there)
    assert doubts.tops_fit([1.0], [1e-6], (F32, F32), 16, 8, 8)
    assert not doubts.tops_fit([1.0], [1e-6], (F32, F16), 16, 8, 8)
    assert not doubts.tops_fit([1e3], [1e3], (F32, F16), 16, 8, 8)  # 1.6e7 past float16's 65504 / 16


def test_settle_reads_every_note_and_redoes_only_the_layers_that_do_not_fit():
    store = doubts.Doubts()
    redone = []
    ordinary = torch.eye(3).expand(2, 3, 3)
    # b: 0.01 in a float16 Gram is below 4 * tiny / eps there (0.25); c: 1e-35 in float32 below its 3.9e-31
    cases = {"a": (ordinary, ordinary), "b": (ordinary.half(), (ordinary * 0.01).half()),
             "c": (ordinary * 1e-35, ordinary), "d": (ordinary, ordinary.half()), "e": (ordinary, 0 * ordinary)}
    for name, (left, right) in cases.items():
        with store.layer(lambda name=name: redone.append(name)):
            assert doubts.deferring()
            doubts.note_grams(left, right, 9, 4, 4)
    assert not doubts.deferring()
    with store.layer(lambda: redone.append("no notes")):
        pass
    assert store.settle() == 2
    assert redone == ["b", "c"]  # e: a Gram of zeros loses nothing
    assert store.settle() == 0  # settled once


def test_float16_factors_are_not_deferred():
    store = doubts.Doubts()
    with store.layer(lambda: None):
        assert doubts.deferring(torch.ones(2, dtype=F32), torch.ones(2, dtype=torch.bfloat16))
        assert not doubts.deferring(torch.ones(2, dtype=F32), torch.ones(2, dtype=F16))
    assert not doubts.deferring(torch.ones(2))
