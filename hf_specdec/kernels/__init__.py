"""Triton kernels of hf_specdec (installed as `hf_specdec.kernels`).

Nothing is imported here: `triton` is optional (the `cuda` / `test` extras), and
`hf_specdec.sampling.rejection_sampler` imports `hf_specdec.kernels.rejection` only when it dispatches
to it (triton is optional); the kernels import their shared parts from `sampling.rejection_reference`.
"""
