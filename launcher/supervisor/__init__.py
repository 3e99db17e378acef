"""Following a job from this machine: ``supervisor`` (the job's controller, the program ``launcher
supervise --job-dir DIR`` that ``launcher submit`` starts: it runs the attempts, starting one agent
per node through a scheduler's ``Transport``, and records how the job ended), ``watch`` (one attempt
followed to its end, its facts gathered for ``launcher.job.verdict``), ``scheduler``
(``SupervisedScheduler``, the base that local, ssh and compose share: submit, state, logs, cancel,
sweep), ``procs`` (finding and stopping a job's processes, orphans included) and ``secrets`` (secret
variables on a node client's stdin, both ends). It may import ``launcher.preflight`` and
``launcher.job``, never a scheduler.
"""
