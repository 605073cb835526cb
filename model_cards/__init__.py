"""Installed as `hf_specdec.model_cards` so `template.md` ships as package data (hf_specdec/model_card.py)."""
