"""Following a job from this machine: ``supervisor`` (the process forked by ``launcher submit`` that
starts one agent per node through a scheduler's ``Transport`` and records how the job ended),
``scheduler`` (``SupervisedScheduler``, the base that local, ssh and compose share: submit, state,
logs, cancel, sweep), ``procs`` (finding and stopping a job's processes, orphans included) and
``secrets`` (secret variables on a node client's stdin, both ends). It may import ``launcher.preflight``
and ``launcher.job``, never a scheduler.
"""
