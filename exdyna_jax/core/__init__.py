"""Foundations every stage reads: the flat view, options, counts, stats and collectives."""
