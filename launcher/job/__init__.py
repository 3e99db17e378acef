"""The job, independent of where it runs: its spec, Plan, record, logs and the launcher's own lines.
Its modules: docs/contributors/architecture.md. The bottom layer of the launcher: it imports only
``gptlaunch.contract``, ``trainer.precheck`` and third-party libraries, and never names a scheduler.
"""
