"""The compose scheduler: one container per node on one Docker engine, on the job's own network.
``options`` (image, engine, GPUs), ``scheduler`` (its ``SupervisedScheduler`` and transport: the
compose project and ``docker start --attach`` per node), ``file`` (the compose file, pure) and ``node``
(the container's entry point: secrets, the parity step, then the node's torchrun). It imports no other
scheduler.
"""
