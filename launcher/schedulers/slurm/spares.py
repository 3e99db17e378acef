"""Hot spares (``--spare-nodes K``) in submitit's batch script: the allocation holds K nodes beyond
the job's, its nodes' step runs on the first ``--nodes``, and the retry step
(``launcher.schedulers.slurm.retry``) runs that same step again on the survivors and a spare."""

from __future__ import annotations

import submitit

from launcher.job.spec import JobSpec
from launcher.schedulers.slurm.options import SlurmOptions


def step_size(spec: JobSpec) -> list[str]:
    """srun's size of the nodes' step when the allocation holds spares (none: all of it)."""
    if not spec.options(SlurmOptions).spare_nodes:
        return []
    return [f"--nodes={spec.nnodes}", f"--ntasks={spec.nnodes}"]


def node_step(executor: submitit.SlurmExecutor) -> str:
    """The nodes' srun line of the batch script, as submitit renders it (its "# command" section)."""
    lines = executor._make_submission_file_text(executor._submitit_command_str, "").splitlines()
    return next(line for line in lines[lines.index("# command") :] if line.startswith("srun "))
