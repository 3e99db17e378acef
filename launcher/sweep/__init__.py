"""Sweeps: many runs from one command (``launcher submit --sweep``)."""
