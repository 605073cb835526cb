"""Accelerate trainers for EAGLE / EAGLE-3 heads (`hf_specdec.trainers`).

They import the head models from `hf_specdec`; the inference library never imports them.
"""
