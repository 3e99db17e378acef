"""A local Plan rendered with fixed facts (nothing resolved on this machine), for the tests of what
reads Plans and job records."""

from __future__ import annotations

import sys
from pathlib import Path

from launcher.job.plan import Plan
from launcher.job.spec import JobSpec
from launcher.schedulers.local.scheduler import LocalFacts, LocalScheduler


def local_plan(spec: JobSpec, job_dir: Path, workdir: Path, job_id: str = "j") -> Plan:
    facts = LocalFacts(
        workdir=str(workdir),
        rdzv_host="127.0.0.1",
        rdzv_port=29500,
        omp_num_threads=1,
        gpus=[],
        agent_python=sys.executable,
    )
    return LocalScheduler().render(spec, facts, job_id, job_dir)
