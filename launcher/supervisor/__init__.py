"""Following a job from this machine: the job's controller (``launcher supervise --job-dir DIR``) and
``SupervisedScheduler``, the base that local, ssh and compose share. Its modules:
docs/contributors/architecture.md. It may import ``launcher.preflight`` and ``launcher.job``, never a
scheduler.
"""
