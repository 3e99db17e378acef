"""The SLURM scheduler: one allocation, the job's controller in its batch step, one step per node, each
a node agent. ``options`` (the partition, time limit, requeues, ...), ``scheduler`` (resolve, render,
submit through submitit or the standalone sbatch script, state, logs, cancel), ``script`` (the sbatch
options and script, pure), ``controller`` and ``transport`` (what runs in the allocation) and ``state``
(states from ``sacct``). It imports no other scheduler.
"""
