"""The syntax of a host name, shared by the Plan (which hosts are worth naming) and the SSH client."""

from __future__ import annotations

import re

# [user@]host: a DNS name, an alias of ~/.ssh/config or an IPv4 address. Never starting with "-" (it
# would be read as an ssh option) and without shell metacharacters.
HOST_RE = re.compile(r"(?:[A-Za-z0-9_][A-Za-z0-9._-]*@)?[A-Za-z0-9_][A-Za-z0-9._-]*")
