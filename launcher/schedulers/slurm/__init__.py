"""The SLURM scheduler: one allocation, one task per node, each a torchrun agent. ``options`` (the
partition, time limit, requeues, ...), ``scheduler`` (resolve, render, submit through submitit or the
standalone sbatch script, state, logs, cancel), ``script`` (the sbatch options and script, pure),
``state`` (states from ``sacct``) and ``task`` (what submitit runs on each node). It imports no other
scheduler.
"""
