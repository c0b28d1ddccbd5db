"""Sending what was chosen: index all-gathers (with a spill), the values' sum, their price."""
