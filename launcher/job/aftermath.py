"""The console leaves out the tracebacks that only follow from a failure; the node logs keep them.

When one rank dies, the console used to show about 120 lines that say nothing new: torchelastic's
``ChildFailedError`` banner from the failed node's torchrun, the ``SignalException`` of the healthy
nodes' torchrun that the launcher stopped, and the healthy ranks' "connection closed by peer"
tracebacks. What failed and where is said once, by the launcher (the retry line, or the job's
summary, from the typed reports). A traceback is held until its last line shows what it is: one of
those is dropped, any other is shown whole, as it came. So is the error of a torchrun whose exit
barrier lost the rendezvous store at a successful end (torch's own race; nothing failed).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

from launcher.job.failures import is_peer_error
from launcher.job.logs import TICK

LINE = re.compile(r"^(?P<label>.*?) \| (?P<prefix>\[rank\d+\]: )?(?P<text>.*)$", re.DOTALL)
HEADER = "Traceback (most recent call last):"
CHAIN = (  # between the tracebacks of one chain of exceptions
    "During handling of the above exception, another exception occurred:",
    "The above exception was the direct cause of the following exception:",
)
# torchrun's own exceptions that follow from a failure the launcher reports: a worker's death, and
# the signal with which the launcher stopped a healthy node's torchrun.
AGENT_CONSEQUENCES = (
    "torch.distributed.elastic.multiprocessing.errors.ChildFailedError",
    "torch.distributed.elastic.multiprocessing.api.SignalException",
)
# A non-host node's torchrun whose rendezvous store went away while its workers ran, after a failure
# showed (an exception above): the store lives in node 0's torchrun, which had ended because of it. It
# is shown when it comes first: node 0's torchrun ended early on its own, or the link to it broke; and
# at the start (node 0 unreachable, the cause), where it comes from another frame.
STORE_LOST = "torch.distributed.elastic.rendezvous.api.RendezvousConnectionError"
WHILE_RUNNING = "in num_nodes_waiting"  # the frame of torchrun's monitor loop, once its workers run
# Python's report of an exception raised inside a logging call (``logging.Handler.handleError``): from
# this line to its "Arguments: " line, a traceback, the call stack and the message; judged as a whole
# by the traceback's last exception (torchrun stopped while it logged: a SignalException).
LOGGING_ERROR = "--- Logging error ---"
# An error record of torch's own logger (torchrun's ``logger.exception``): each of its lines starts with
# the same ``E<mmdd> <time> <pid> <path>:<line>] ``, the traceback's included. Held until the record
# ends (a line without that prefix, or a TICK) and judged by its traceback's last exception, as above.
TORCH_ERROR = re.compile(r"^E\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\] ")
# torchrun's error record when its exit barrier (its own workers all ended) lost the rendezvous store:
# node 0's torchrun, which holds the store, passed the barrier and exited before this one's wait came
# back (torch's own race). Nothing failed: torchrun logs it and exits as it would have.
EXIT_BARRIER = "Error waiting on exit barrier"
STORE_CLOSED_ERROR = "torch.distributed.DistNetworkError"  # the store's connection closed
# c10d's C++ warning that a store connection closed (``[W1206 18:20:12.0 TCPStore.cpp:138] [c10d]
# ... Failed to recv, got 0 bytes``), then its C++ backtrace: never anything for the console, and the
# Python error that follows it (the exit barrier's, a lost rendezvous) is judged on its own.
STORE_CLOSED = re.compile(r"^\[[WE]\d{4} [\d:.]+ \S+\.cpp:\d+\] \[c10d\] .*Failed to recv")
CPP_TRACE = re.compile(r"^(?:Exception raised from |frame #\d+: |<omitting python frames>$|$)")
BANNER = "=" * 20  # torchrun's failure summary sits between two lines of "=" after ChildFailedError
BANNER_LINES = 40  # at most this many lines are dropped as the summary, whatever follows
MAX_HELD = 400  # a traceback longer than this is shown (lines), whatever it is
# A healthy rank's error when a peer died: a "closed by peer" or timeout (``is_peer_error``) from
# torch.distributed's own layers; the same words from the user's code (an HTTP timeout) are not.
DISTRIBUTED = re.compile(r"gloo|nccl|c10d|torch\.distributed|Dist\w*Error|ProcessGroup", re.IGNORECASE)


def quieted(lines: Iterable[str]) -> Iterator[str]:
    """``lines`` (``LABEL | [rankN]: text``, or a node's own ``LABEL | text``; TICK passes) without
    the tracebacks that follow from a failure, per node and rank."""
    quiet = _Quiet()
    for line in lines:
        yield from quiet.feed(line)
    for key in list(quiet.held):
        yield from quiet.finish(key)
    for label in list(quiet.reports):
        yield from quiet.reports.pop(label)
    for label in list(quiet.records):
        yield from quiet.end_record(label)


class _Quiet:
    def __init__(self) -> None:
        self.held: dict[tuple[str, str], list[str]] = {}  # (label, rank prefix) -> a traceback so far
        self.ended: dict[tuple[str, str], str] = {}  # its last exception line, once it came
        # label -> ("=" lines of ChildFailedError's summary still to come, lines still to drop at most)
        self.banners: dict[str, tuple[int, int]] = {}
        self.failed = False  # an exception that follows from a failure has come (any node, any rank)
        self.reports: dict[str, list[str]] = {}  # label -> a logging error report so far
        self.records: dict[str, tuple[str, list[str]]] = {}  # label -> (lines' start, lines): a torch error
        self.store_closed: set[str] = set()  # labels in c10d's warning of a closed store (left out)

    def feed(self, line: str) -> list[str]:
        """What to show now that ``line`` came. A traceback is judged by its chain's last exception
        ("During handling of the above exception..."): at the next line that is not part of it, or
        at a TICK (nothing new came)."""
        if line == TICK:
            self.store_closed.clear()  # a C++ warning comes in one write: by now it ended
            ended = [key for key in self.held if key in self.ended]
            records = [out for label in list(self.records) for out in self.end_record(label)]
            return [out for key in ended for out in self.finish(key)] + records + [TICK]
        match = LINE.match(line)
        if match is None:
            return [line]
        label, prefix, text = match["label"], match["prefix"] or "", match["text"].rstrip("\n")
        key = (label, prefix)
        in_warning = label in self.store_closed and CPP_TRACE.match(text)
        if not prefix and (in_warning or STORE_CLOSED.match(text)):
            self.store_closed.add(label)  # c10d's warning, then its C++ backtrace: left out
            return []
        self.store_closed.discard(label)
        record = None if prefix else TORCH_ERROR.match(text)
        if label in self.records and (record is None or record[0] != self.records[label][0]):
            return self.end_record(label) + self.feed(line)  # the record ended before this line
        if record is not None:
            self.records.setdefault(label, (record[0], []))[1].append(line)
            return []
        if not prefix and (text == LOGGING_ERROR or label in self.reports):
            return self._report(label, line, text)
        if not prefix and label in self.banners:
            rules, budget = self.banners.pop(label)
            rules -= text.startswith(BANNER)
            if rules and budget > 1:
                self.banners[label] = (rules, budget - 1)
            return []
        if key in self.ended and not (text in CHAIN or text == "" or text == HEADER):
            return self.finish(key) + self.feed(line)  # the traceback ended before this line
        if key not in self.held:
            if text != HEADER:
                return [line]
            self.held[key] = []
        block = self.held[key]
        block.append(line)
        if text == HEADER:
            self.ended.pop(key, None)  # the chain goes on
        elif len(block) >= MAX_HELD:
            return self.finish(key, judge=False)
        elif key not in self.ended and text and not text.startswith((" ", "\t")):
            self.ended[key] = text  # its exception: a chain may follow
            self.failed |= text.startswith(AGENT_CONSEQUENCES) or self._peer_error(prefix, text)
        return []

    def finish(self, key: tuple[str, str], judge: bool = True) -> list[str]:
        """The traceback held for ``key``, ended: what of it to show."""
        block, last = self.held.pop(key), self.ended.pop(key, None)
        if judge and last is not None and self._consequence(*key, last, block):
            return []
        return block

    def _consequence(self, label: str, prefix: str, text: str, block: list[str]) -> bool:
        """Whether a traceback ``block`` that ends with ``text`` only follows from a failure."""
        if prefix:
            return self._peer_error(prefix, text)
        if "ChildFailedError" in text:
            self.banners[label] = (2, BANNER_LINES)
        if text.startswith(STORE_LOST):
            return self.failed and any(WHILE_RUNNING in line for line in block)
        return text.startswith(AGENT_CONSEQUENCES)

    def end_record(self, label: str) -> list[str]:
        """The torch error record held for ``label``, ended: dropped when its traceback's last
        exception follows from a failure, else shown whole."""
        start, block = self.records.pop(label)
        texts = [m["text"].rstrip("\n")[len(start) :] for m in map(LINE.match, block) if m is not None]
        if HEADER not in texts:
            return block
        traceback = texts[texts.index(HEADER) :]
        if texts[0].startswith(EXIT_BARRIER) and _raised(traceback)[-1].startswith(STORE_CLOSED_ERROR):
            return []
        return [] if self._follows(traceback) else block

    def _report(self, label: str, line: str, text: str) -> list[str]:
        """A line of a logging error report: held until its end, then dropped when its traceback's
        last exception follows from a failure, else shown whole."""
        block = self.reports.setdefault(label, [])
        block.append(line)
        if not text.startswith("Arguments: ") and len(block) < MAX_HELD:
            return []
        del self.reports[label]
        texts = [m["text"].rstrip("\n") for m in map(LINE.match, block) if m is not None]
        stack = texts.index("Call stack:") if "Call stack:" in texts else len(texts)
        return [] if self._follows(texts[:stack]) else block

    def _follows(self, traceback: list[str]) -> bool:
        """Whether a traceback's texts (its chain's too) end with an exception that follows from a
        failure (noted in ``failed``)."""
        raised = _raised(traceback)
        follows = bool(raised) and raised[-1].startswith(AGENT_CONSEQUENCES)
        self.failed |= follows
        return follows

    @staticmethod
    def _peer_error(prefix: str, text: str) -> bool:
        """A rank's error when a peer died (torch.distributed's "closed by peer", a timeout)."""
        return bool(prefix) and DISTRIBUTED.search(text) is not None and is_peer_error(text)


def _raised(traceback: list[str]) -> list[str]:
    """A traceback's (and its chain's) exception lines: its texts that are not indented."""
    return [t for t in traceback if t and not t.startswith((" ", "\t"))]
