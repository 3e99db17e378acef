"""Checks before and at the start of a job, run on the hosts themselves: ``probe`` (what a host runs:
Python, torch, CUDA, NCCL, packages, GPUs, interfaces, routes), ``parity`` (which probed versions must
match, and the diff), ``parity_step`` (the same check as a job's first step, for SLURM and compose),
``collective`` (a short all_reduce across every rank) with ``health`` (its bandwidth formula and
tables, and the health gate's verdict, read without torch), and ``netcheck`` (is the rendezvous port
reachable). Each worker module runs as ``python -m launcher.preflight.<name>``. It may import
``launcher.job`` only.
"""
