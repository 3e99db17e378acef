"""The job, independent of where it runs: ``spec`` (JobSpec, validated at the edge), ``options`` (what
every scheduler's options model shares) and ``registry`` (the entry-point list of schedulers),
``plan`` (the Plan: every process a job starts, and the typed facts a scheduler resolved), ``torchrun``
(a node's torchrun command line and container mounts), ``placeholders`` and ``node`` (values only a
node knows, filled in on the node), ``record`` (the job's directory and status), ``logs`` (node logs as
one stream, followed until the job ends), ``failures`` (the root cause of a failure) and ``console``
(the launcher's own lines). The bottom layer of the launcher: it imports only ``gptlaunch.contract``,
``trainer.precheck`` and third-party libraries, and never names a scheduler.
"""
