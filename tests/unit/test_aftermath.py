"""The console leaves out what only follows from a failure (torchrun's ChildFailedError banner, the
SignalException of a torchrun the launcher stopped, a healthy rank's "closed by peer"), and shows any
other traceback whole, as it came."""

from __future__ import annotations

from launcher.job.aftermath import BANNER_LINES, quieted
from launcher.job.logs import TICK
from tests.unit.torchrun_output import CHILD_FAILED, FAILED


def _node(label: str, text: str) -> list[str]:
    return [f"{label} | {line}\n" for line in text.strip("\n").splitlines()]


# torchrun's exit on a worker killed by SIGKILL, as a node log holds it
EXIT = f"""{FAILED}
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "/venv/lib/python3.11/site-packages/torch/distributed/run.py", line 936, in main
    run(args)
{CHILD_FAILED}agent: torchrun exited with code 1
"""
STOPPED = """
Traceback (most recent call last):
  File "{TE}/multiprocessing/api.py", line 85, in _h
    raise SignalException(f"Process {os.getpid()} got signal: {sigval}", sigval=sigval)
torch.distributed.elastic.multiprocessing.api.SignalException: Process 26400 got signal: 15
"""
PEER = """
[rank0]: Traceback (most recent call last):
[rank0]:   File "/repo/trainer/step.py", line 73, in train_step
[rank0]:     stats = distributed.all_reduce_sum(
[rank0]: RuntimeError: [gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.231.0.12]:4242
"""
OWN = """
[rank1]: Traceback (most recent call last):
[rank1]:   File "/repo/train.py", line 12, in <module>
[rank1]:     loss = model(x)
[rank1]: ValueError: shapes (4, 8) and (9, 8) do not match
"""


def test_what_follows_from_a_failure_is_left_out_and_the_rest_kept_in_order() -> None:
    lines = [
        *_node("node1", "[rank1]: step 3 | loss 8.1"),
        *_node("node1", EXIT),
        TICK,
        *_node("node0", STOPPED),
        *_node("node0", PEER),
    ]
    shown = [line for line in quieted(lines) if line != TICK]
    assert shown == [
        "node1 | [rank1]: step 3 | loss 8.1\n",
        f"node1 | {FAILED}\n",
        "node1 | agent: torchrun exited with code 1\n",
    ]


def test_a_ranks_own_error_is_shown_whole_even_interleaved_with_a_peers() -> None:
    own, peer = _node("node1", OWN), _node("node0", PEER)
    interleaved = [line for pair in zip(own, peer, strict=True) for line in pair]
    assert list(quieted(interleaved)) == own


def test_a_traceback_cut_short_by_the_end_of_the_stream_is_shown() -> None:
    cut = _node("node1", OWN)[:3]
    assert list(quieted(cut)) == cut


def test_a_users_own_timeout_is_shown_and_a_summary_cut_short_stops_being_dropped() -> None:
    error = "ValueError: shapes (4, 8) and (9, 8) do not match"
    own = _node("node0", OWN.replace(error, "TimeoutError: the HTTP read timed out"))
    assert list(quieted(own)) == own  # "timed out" from the user's code, not torch.distributed's
    # a summary whose closing "=" line never comes (a node killed mid-print): the node's later
    # lines are shown again after BANNER_LINES
    cut = _node("node1", EXIT.split("trainer.cli FAILED")[0])
    later = [f"node1 | agent: line {k}\n" for k in range(BANNER_LINES + 5)]
    shown = list(quieted([*cut, *later]))
    assert shown[-5:] == later[-5:] and len(shown) < 5 + BANNER_LINES, shown


# torchrun stopped twice while it logged the first stop: one chain of three tracebacks (as a CI run had)
CHAINED = f"""
{STOPPED.strip()}

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "/usr/lib/python3.11/logging/__init__.py", line 1742, in isEnabledFor
    return self._cache[level]
KeyError: 30

During handling of the above exception, another exception occurred:

{STOPPED.strip()}
"""


def test_a_chain_of_tracebacks_is_judged_by_its_last_exception() -> None:
    lines = [*_node("node1", CHAINED), "node1 | agent: torchrun exited with code 1\n"]
    assert list(quieted(lines)) == ["node1 | agent: torchrun exited with code 1\n"]
    own = _node("node1", CHAINED.rsplit("During", 1)[0])
    # a chain that ends with the user's own error (here a KeyError) is shown whole, at the next TICK
    assert [line for line in quieted([*own, TICK]) if line != TICK] == own


# node 1's torchrun when node 0's torchrun, the rendezvous store's host, ended first (as a CI run had)
STORE = (
    "torch.distributed.elastic.rendezvous.api.RendezvousConnectionError: "
    "The connection to the C10d store has failed. See inner exception for details."
)
TE = "/venv/lib/python3.11/site-packages/torch/distributed/elastic"
STORE_LOST = f"""
Traceback (most recent call last):
  File "{TE}/rendezvous/c10d_rendezvous_backend.py", line 114, in _call_store
    return getattr(self._store, store_op)(*args, **kwargs)
torch.distributed.DistNetworkError: failed to recv, got 0 bytes

The above exception was the direct cause of the following exception:

Traceback (most recent call last):
  File "{TE}/agent/server/api.py", line 959, in _invoke_run
    num_nodes_waiting = rdzv_handler.num_nodes_waiting()
  File "{TE}/rendezvous/dynamic_rendezvous.py", line 1269, in num_nodes_waiting
    self._state_holder.sync()
{STORE}
"""
# the same error at the start: node 0 cannot be reached, which is the cause
UNREACHABLE = f"""
Traceback (most recent call last):
  File "{TE}/rendezvous/c10d_rendezvous_backend.py", line 158, in _create_tcp_store
    store = TCPStore(
torch.distributed.DistNetworkError: The client socket timed out after 60000ms connecting to (gl-h1, 29500).

The above exception was the direct cause of the following exception:

Traceback (most recent call last):
  File "{TE}/rendezvous/c10d_rendezvous_backend.py", line 240, in create_backend
    store = _create_tcp_store(params)
{STORE}
"""


def test_a_store_lost_after_a_failure_is_left_out_and_one_lost_first_or_never_reached_is_shown() -> None:
    ended = "node1 | agent: torchrun exited with code 1\n"
    after = [*_node("node0", PEER), *_node("node0", EXIT), *_node("node1", STORE_LOST), ended]
    assert [line for line in quieted(after) if "node1" in line] == [ended]
    first = _node("node1", STORE_LOST)  # nothing failed before: node 0's torchrun ended on its own
    assert list(quieted([*first, ended])) == [*first, ended]
    unreachable = _node("node1", UNREACHABLE)
    assert list(quieted([*_node("node0", STOPPED), *unreachable, ended])) == [*unreachable, ended]


# torchrun stopped by the launcher while it logged its log tailer's error (as a CI run had): Python's
# logging error report, whose "Arguments:" line names the SignalException again
LOGGING = f"""
--- Logging error ---
{STOPPED.strip()}

During handling of the above exception, another exception occurred:

{STOPPED.strip()}
Call stack:
  File "{TE}/multiprocessing/tail_log.py", line 154, in stop
    logger.exception(
Message: 'error in log tailer for %s%s. %s'
Arguments: ('default', 0, 'SignalException')
"""


def test_a_logging_error_report_of_a_stopped_torchrun_is_left_out_and_another_is_shown() -> None:
    ended = "node0 | agent: torchrun exited with code 1\n"
    assert list(quieted([*_node("node0", LOGGING), ended])) == [ended]
    own = _node("node0", LOGGING.replace(STOPPED.strip().splitlines()[-1], "KeyError: 30"))
    assert list(quieted([*own, ended])) == [*own, ended]
    cut = _node("node0", LOGGING)[:6]  # the stream ended mid-report: shown
    assert list(quieted(cut)) == cut


# torchrun stopped by the launcher while its log tailer's error was logged by torch's own logger (as a
# CI run had): every line of the record, the traceback's too, starts with the same prefix
TE_LOG = "E1202 02:19:33.481000 18912 {TE}/multiprocessing/tail_log.py:154] "
TAILER = "\n".join(
    TE_LOG + line
    for line in ["error in log tailer for default0. SignalException", *STOPPED.strip().splitlines()]
)


def test_a_torch_error_record_of_a_stopped_torchrun_is_left_out_and_another_is_shown() -> None:
    failed = "node0 | E1202 02:19:35.803000 18912 {TE}/multiprocessing/api.py:1002] failed (exitcode: 1)\n"
    ended = "node0 | agent: torchrun exited with code 1\n"
    assert list(quieted([*_node("node0", TAILER), failed, ended])) == [failed, ended]
    own = _node("node0", TAILER.replace(STOPPED.strip().splitlines()[-1], "KeyError: 30"))
    assert list(quieted([*own, TICK, ended])) == [*own, TICK, ended]
    assert list(quieted([failed])) == [failed]  # a record without a traceback: shown as it came


# A successful attempt's end, as a CI run's node 1 had it: node 0's torchrun, which holds the rendezvous
# store, passed the exit barrier and exited before node 1's wait came back (torch's own race): c10d's C++
# warning with its backtrace, then torchrun's error record; its exit code is 0 all the same.
CPP_STORE_CLOSED = """
[W1206 18:50:35.334512403 TCPStore.cpp:138] [c10d] recvValueWithTimeout failed on SocketImpl(fd=7, addr=[::ffff:127.0.0.1]:57484, remote=[::ffff:127.0.0.1]:29611): Failed to recv, got 0 bytes. Connection was likely closed. Did the remote server shutdown or crash?
Exception raised from recvBytes at /__w/pytorch/pytorch/torch/csrc/distributed/c10d/Utils.hpp:787 (most recent call first):
frame #0: c10::Error::Error(c10::SourceLocation, std::__cxx11::basic_string<char, std::char_traits<char>, std::allocator<char> >) + 0x9d (0x7fed3b179b8d in /venv/lib/python3.11/site-packages/torch/lib/libc10.so)
frame #5: c10d::TCPStore::doWait(c10::ArrayRef<std::__cxx11::basic_string<char, std::char_traits<char>, std::allocator<char> > >, std::chrono::duration<long, std::ratio<1l, 1000l> >) + 0xc5 (0x7fed2cd in /venv/lib/python3.11/site-packages/torch/lib/libtorch_cpu.so)
<omitting python frames>
frame #20: _start + 0x21 (0x55eab1ec2081 in /venv/bin/python)

"""  # noqa: E501
BARRIER_LOG = "E1206 18:20:12.091000 5069 {TE}/agent/server/api.py:1008] "
BARRIER = "\n".join(
    BARRIER_LOG + line
    for line in [
        "Error waiting on exit barrier. Elapsed: 0.016031503677368164 seconds",
        "Traceback (most recent call last):",
        '  File "{TE}/agent/server/api.py", line 994, in _exit_barrier',
        "    store_util.barrier(",
        '  File "{TE}/utils/store.py", line 201, in barrier',
        "    store.wait([last_member_key])",
        "torch.distributed.DistNetworkError: Failed to recv, got 0 bytes. Connection was likely closed. "
        "Did the remote server shutdown or crash?",
    ]
)


def test_an_exit_barrier_that_lost_the_store_after_a_success_is_left_out_and_a_timeout_shown() -> None:
    step = "node1 | [rank1]: step 30 | loss 5.2\n"
    ended = "node1 | agent: torchrun exited with code 0\n"
    lines = [step, *_node("node1", CPP_STORE_CLOSED), "node1 | \n", *_node("node1", BARRIER), ended]
    assert list(quieted(lines)) == [step, ended]
    assert list(quieted([*_node("node1", CPP_STORE_CLOSED), TICK, step])) == [TICK, step]
    timeout = _node("node1", BARRIER.replace("DistNetworkError: Failed to recv", "DistStoreError: Timeout"))
    assert list(quieted([*timeout, ended])) == [*timeout, ended]  # another node never ended: shown
