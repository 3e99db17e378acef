"""Checks before and at the start of a job, run on the hosts themselves: what each host runs and
whether the hosts match (``probe``, ``parity``), whether the network and devices are healthy (the
health gate: ``collective``, ``health``) and whether the rendezvous port is reachable (``netcheck``).
Worker modules run as ``python -m launcher.preflight.<name>``. May import ``launcher.job`` only.
"""
