"""A real browser for pages the launcher writes: Debian's headless Chromium, run in a network
namespace of its own (``unshare -n``: no interface but a loopback that is down), so a page that
needs the network shows it. Missing Chromium or ``unshare`` fails under CI=true, else skips."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

from tests.conftest import missing_component

ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"  # screenshots the tests keep (git-ignored)


def _chromium(page: Path, *flags: str, cwd: Path) -> str:
    chromium = shutil.which("chromium")
    if chromium is None or shutil.which("unshare") is None:
        missing_component("headless Chromium is not installed (apt-get install chromium)")
    argv = [
        "unshare", "-n", chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
        "--window-size=1300,2600", "--virtual-time-budget=20000", *flags, page.resolve().as_uri(),
    ]  # fmt: skip
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=cwd, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def dump_dom(page: Path, tmp_path: Path) -> str:
    """The page's DOM once its scripts ran, with no network."""
    return _chromium(page, "--dump-dom", cwd=tmp_path)


def screenshot(page: Path, name: str, tmp_path: Path) -> Path:
    """A PNG of the page, kept in ``artifacts/NAME``; returns its path."""
    ARTIFACTS.mkdir(exist_ok=True)
    out = ARTIFACTS / name
    _chromium(page, f"--screenshot={out}", cwd=tmp_path)
    assert out.stat().st_size > 10_000, out  # a page, not a blank
    return out


def chart(dom: str, name: str) -> str:
    """The part of ``dom`` from chart ``name``'s div to the next heading: its SVG and its figure's data."""
    start = dom.find(f'<div id="chart-{name}"')
    return "" if start < 0 else dom[start : dom.find("<h2", start)]


def traces(dom: str, name: str) -> int:
    """The traces plotly drew in chart ``name`` (0 when it drew none, or there is no such chart)."""
    part = chart(dom, name)
    if 'class="main-svg"' not in part:
        return 0
    return len(re.findall(r'<g class="trace (?:scatter|bars)', part))
