"""Which lines of a followed job the launcher's console shows (``--tee``): with many nodes, node 0's
(rank 0's) and every node's warnings and errors; with few, or ``--tee all``, every line."""

from __future__ import annotations

from launcher.job.console import TEE_ALL_MAX_NODES, console_lines

LINES = {
    "node0 | [rank0]: step 10 | loss 5.1 | 41000 tokens/s": True,
    "node0 | agent: torchrun started": True,  # node 0's agent, not a rank
    "gl-h1 node0 | [rank0]: step 11 | loss 5.0": True,  # a label with the host's name
    "node0 | [rank1]: step 10 | loss 5.1": False,  # node 0's other ranks repeat rank 0
    "node7 | [rank7]: step 10 | loss 5.1": False,
    "node7 | agent: torchrun started": False,
    "node7 | [rank7]: UserWarning: TypedStorage is deprecated": True,
    "node7 | [rank7]: Traceback (most recent call last):": True,
    "node7 | [rank7]: RuntimeError: NCCL error in: ProcessGroupNCCL.cpp:1970": True,
    "node7 | W1125 04:12:01.123000 99 torch/distributed/elastic/agent/server/api.py:719] Received 15": True,
    "node7 | E1125 04:12:01.123000 99 torch/distributed/elastic/multiprocessing/api.py:869] failed": True,
    "node7 | [rank7]: loss is nan at step 12": True,
    "node7 | launcher: host agent: lease lost, ending the node": True,
    "node7 | agent: cannot start 'python': No such file or directory": True,
    "node7 | launcher: host agent: the node timed out": True,
}


def test_many_nodes_show_rank_0_and_every_warning_or_error() -> None:
    keep = console_lines("auto", TEE_ALL_MAX_NODES + 1)
    assert {line: keep(line) for line in LINES} == LINES


def test_few_nodes_or_tee_all_show_every_line_and_rank0_filters_even_two_nodes() -> None:
    assert all(map(console_lines("auto", TEE_ALL_MAX_NODES), LINES))
    assert all(map(console_lines("all", 16), LINES))
    assert not console_lines("rank0", 2)("node1 | [rank1]: step 10 | loss 5.1")


NOISE = [
    "node1 | [rank1]: [W1126 11:51:51.628947673 WorkerServer.cpp:113] [c10d] Server listening to UNIX "
    "/tmp/gptlaunch-0/fr-f6df16badc4372e7-1.sock",
    "node0 | [rank0]: [W1126 11:51:51.6 socket.cpp:752] [c10d] The hostname of the client socket cannot be "
    "retrieved. err=-3",
    "node1 | E1126 16:45:18.1 3245 torch/distributed/elastic/multiprocessing/errors/error_handler.py:145] "
    "no error file defined for parent, to copy child error file (/tmp/j/torchelastic/node-1/0/error.json)",
]


def test_lines_every_rank_prints_alike_to_no_purpose_are_never_on_the_console() -> None:
    for tee, nnodes in (("all", 2), ("auto", 2), ("auto", 16), ("rank0", 2)):
        assert not any(map(console_lines(tee, nnodes), NOISE)), tee  # node logs keep them
