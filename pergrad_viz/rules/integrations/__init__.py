"""Rules for layer types of optional libraries (Hugging Face ``transformers``, ``timm``), registered by class path:
nothing here imports those libraries; a rule is resolved when a module of its class is first looked up (see
``pergrad_viz.rules``). Each registration carries a copy of the forward it was written for (``forward_like``), so
that a release that changes that forward sends the layer to the per-layer fallback instead of a wrong rule."""
