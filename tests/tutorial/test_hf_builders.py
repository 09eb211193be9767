"""The tutorial's Hugging Face / timm builders: tiny models from configs, the user's process left as it was."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("transformers")

from pergrad_viz.tutorial import hf_models  # noqa: E402


@pytest.mark.parametrize("build", ["gpt2", "bert"])
def test_a_builder_leaves_the_environment_as_it_was(monkeypatch, build):
    """Found by a probe: every builder set HF_HUB_OFFLINE=1 for the rest of the process (a user's later
    from_pretrained stayed offline); they build from configs, so nothing comes from a hub either way."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    model = getattr(hf_models, build)()
    assert sum(p.numel() for p in model.parameters()) > 0
    assert "HF_HUB_OFFLINE" not in os.environ  # (torch's inductor, imported by transformers, sets its own cache dir)


@pytest.mark.parametrize("build", ["lora_llama", "fashion_vit_lora"])
def test_a_lora_builder_shows_no_library_deprecation(recwarn, build):
    """peft reads transformers' deprecated ``is_gradient_checkpointing`` when it wraps a model: every LoRA builder (not
    only notebook 06's) keeps that notice from the user's output (`bench --dp` printed it for lora-llama)."""
    pytest.importorskip("peft")
    import warnings

    warnings.simplefilter("always")
    getattr(hf_models, build)()
    assert not [w for w in recwarn if "is_gradient_checkpointing" in str(w.message)]
