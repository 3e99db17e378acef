"""The local scheduler: ``nnodes`` emulated nodes on this machine, one torchrun agent each, followed by
the supervisor (``launcher.supervisor``). ``options`` holds its options model, ``scheduler`` its
``SupervisedScheduler`` and transport. It imports no other scheduler.
"""
