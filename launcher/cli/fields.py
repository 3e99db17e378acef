"""The config file's fields beside their flags, for ``launcher submit --help``."""

from __future__ import annotations

from collections.abc import Collection

from pydantic import BaseModel

from launcher.cli.flags import _help, _members, flag_name
from launcher.job.registry import scheduler_kinds
from launcher.job.spec import JobSpec


def describe_fields(
    model: type[BaseModel] = JobSpec, prefix: str = "", shown: Collection[str] | None = None
) -> list[tuple[str, str, str]]:
    """(dotted name, its flag or "", help) of every config-file field, nested models flattened: for
    --help. ``shown``: the schedulers whose own fields are listed (None: every one)."""
    rows: list[tuple[str, str, str]] = []
    for name, info in model.model_fields.items():
        models = [m for m in _members(info.annotation) if isinstance(m, type) and issubclass(m, BaseModel)]
        if prefix + name == "scheduler" and shown is not None:
            models = [m for m in models if m.model_fields["kind"].default in shown]
        if models:
            for sub in models:  # a field that several schedulers share is listed once
                rows += [row for row in describe_fields(sub, f"{prefix}{name}.", shown) if row not in rows]
            continue
        # ``scheduler.*``: ``model`` is a scheduler's options, whose flag it is; "": a field without one
        kind = model.model_fields["kind"].default if prefix.startswith("scheduler.") else None
        if (row := (prefix + name, flag_name(kind, prefix + name) or "", _help(info))) not in rows:
            rows.append(row)
    return rows


def fields_help(shown: Collection[str] | None = None) -> str:
    """The config file's fields beside their flags; ``shown``: as in ``describe_fields``."""
    rows = [f"  {name:32} {flag:27} {text}" for name, flag, text in describe_fields(shown=shown)]
    text = "config file fields (YAML; nested as rendezvous: {port: 29500}) and their flags:\n"
    text += "\n".join(rows)
    if shown is not None and not shown:
        kinds = ", ".join(scheduler_kinds())
        text += (
            f"\n\neach scheduler's own flags and fields: launcher submit --scheduler NAME --help ({kinds})"
        )
    return text
