"""Sweeps: many runs from one command (`launcher submit --sweep`): their points, record, driver and
table. Imports `launcher.schedulers` and `launcher.job`; only `launcher.cli` imports it."""
