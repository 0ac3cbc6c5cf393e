"""Tiny MoE model factories and the HF <-> Megatron name maps per model family."""
from .tiny import FAMILIES, SIZES, get_model

__all__ = ["FAMILIES", "SIZES", "get_model"]
