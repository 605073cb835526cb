"""Sampling: the step's draft metadata, logits processing per verify position, and rejection
sampling (the PyTorch reference here; the Triton kernels in `hf_specdec.kernels`)."""
