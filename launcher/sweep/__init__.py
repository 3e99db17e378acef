"""Sweeps: many runs from one command (`launcher submit --sweep`): their points, record, driver and
table. Imports `launcher.schedulers`, `launcher.supervisor` and `launcher.job`; only `launcher.cli`
imports it, and `launcher.report` its table's facts."""
