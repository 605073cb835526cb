"""Triton kernels of hf_specdec (installed as `hf_specdec.kernels`).

Nothing is imported here: `triton` is optional (the `cuda` / `test` extras), and
`hf_specdec.rejection_sampler` imports `hf_specdec.kernels.rejection` only when it dispatches to it.
"""
