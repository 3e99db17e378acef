"""The SLURM scheduler: one allocation, the job's controller in its batch step, one step per node,
each a node agent. Its modules: docs/contributors/architecture.md. It imports no other scheduler.
"""
