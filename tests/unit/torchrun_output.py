"""What torchrun prints into a node log when a worker dies (torch 2.13, a worker killed by SIGKILL):
the tests of the root cause and of the console share it."""

FAILED = (
    "E1124 14:43:20.992000 26423 multiprocessing/api.py:1002] failed (exitcode: -9) local_rank: 0 "
    "(pid: 26428)"
)
# the end of torchrun's traceback: its exception and the failure summary
CHILD_FAILED = """torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
trainer.cli FAILED
------------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-24_14:43:20
  host      : gl-h2
  rank      : 1 (local_rank: 0)
  exitcode  : -9 (pid: 26428)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 26428
============================================================
"""
