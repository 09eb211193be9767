"""What per-sample gradients are for, computed from the rules without materialising where possible:
gradient norms (:mod:`.norms`), the empirical NTK (:mod:`.ntk`), clipping and DP-SGD (:mod:`.clipping`)."""
