"""Choosing indices: per-row and threshold selection, top-k, the threshold controllers."""
