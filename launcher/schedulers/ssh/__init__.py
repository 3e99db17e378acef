"""The SSH scheduler: one torchrun agent per host through the system OpenSSH client. ``options`` (hosts,
hostfile, ssh options), ``scheduler`` (its ``SupervisedScheduler`` and transport), ``client`` (ssh
itself: settings, host names, commands on many hosts at once), ``hosts`` (every check before a launch:
probes, parity, workdir, master address, interfaces, rendezvous port, collective). On each host the
node agent runs (``python -m launcher.agent run|signal|status``). It imports no other scheduler.
"""
