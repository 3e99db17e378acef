"""The SSH scheduler: one torchrun agent per host through the system OpenSSH client. ``options`` (hosts,
hostfile, ssh options), ``scheduler`` (its ``SupervisedScheduler`` and transport), ``client`` (ssh
itself: settings, host names, commands on many hosts at once), ``hosts`` (every check before a launch:
probes, parity, workdir, master address, interfaces, rendezvous port, collective), ``hostagent`` (the
host side of a node: run, signal, status) and ``private`` (directories only this user may use). It
imports no other scheduler.
"""
