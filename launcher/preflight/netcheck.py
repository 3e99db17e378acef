"""Is the rendezvous port reachable? ``python -m launcher.preflight.netcheck listen|connect``, run over ssh.

Before an SSH job starts, host 0 listens on the rendezvous port (``listen PORT``) while every other
host connects to ``master_addr:PORT`` (``connect ADDR PORT``): a firewall, a port in use or an address
that does not route shows up here in seconds, named, instead of as a rendezvous that times out after
minutes. Prints one word and exits 0 on success; on failure prints the reason and exits 1. Imports
nothing heavy: it starts in a few tens of milliseconds.
"""

from __future__ import annotations

import argparse
import socket
import sys
import time

ACCEPT_POLL_S = 0.2


def listen(port: int, expect: int, timeout_s: float) -> int:
    """Accept ``expect`` connections on ``port`` (all addresses) within ``timeout_s`` seconds."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            server.bind(("", port))
        except OSError as e:
            print(f"port {port} cannot be bound here: {e.strerror}", flush=True)
            return 1
        server.listen(max(1, expect))
        print("listening", flush=True)
        server.settimeout(ACCEPT_POLL_S)
        deadline, accepted = time.monotonic() + timeout_s, 0
        while accepted < expect and time.monotonic() < deadline:
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            conn.close()
            accepted += 1
    if accepted < expect:
        print(f"only {accepted} of {expect} host(s) connected within {timeout_s:.0f} s", flush=True)
        return 1
    print("ok", flush=True)
    return 0


def connect(address: str, port: int, timeout_s: float) -> int:
    """Connect to ``address:port``, retrying until ``timeout_s`` seconds passed (the listener may
    not be up yet)."""
    deadline, error = time.monotonic() + timeout_s, "no attempt"
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((address, port), timeout=max(0.5, deadline - time.monotonic())):
                print("ok", flush=True)
                return 0
        except OSError as e:
            error = e.strerror or str(e)
            time.sleep(ACCEPT_POLL_S)
    print(f"cannot connect to {address}:{port} within {timeout_s:.0f} s: {error}", flush=True)
    return 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m launcher.preflight.netcheck", description=__doc__.split("\n\n")[0]
    )
    sub = p.add_subparsers(dest="action", required=True)
    ls = sub.add_parser("listen")
    ls.add_argument("port", type=int)
    ls.add_argument("--expect", type=int, default=1, help="connections to wait for")
    cs = sub.add_parser("connect")
    cs.add_argument("address")
    cs.add_argument("port", type=int)
    for s in (ls, cs):
        s.add_argument("--timeout-s", type=float, default=10.0)
    args = p.parse_args(argv)
    if args.action == "listen":
        return listen(args.port, args.expect, args.timeout_s)
    return connect(args.address, args.port, args.timeout_s)


if __name__ == "__main__":
    sys.exit(main())
