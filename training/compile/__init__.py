"""torch.compile's settings (options.py: prepare_compile) and our work-arounds for TorchInductor:
a barrier against a LayerNorm-kernel race, a lowering-message fix, persistent-row reductions."""
