"""Optimizers and modes around a method: sparse AdamW, local steps, hierarchical exchange."""
