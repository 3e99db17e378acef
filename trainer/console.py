"""A clean console: the trainer's own lines and real warnings, not torch's internal chatter.

By default ``quiet_torch_chatter`` silences, in this process only:

- Inductor's autotune tables ("AUTOTUNE bmm(...)" with its timings, "Autotune Choices Stats"), which
  max-autotune compiles (the CPU default) write straight to stderr, through Inductor's own config
  switches ``autotune_num_choices_displayed`` and ``max_autotune_report_choices_stats``;
- two known-harmless warnings, each matched by its exact message: the "TypedStorage is deprecated"
  UserWarning raised from inside torch (Inductor's select_algorithm calls ``.storage()``), and Dynamo's
  "Profiler record function ... will be ignored" log line (DDP's forward opens a ``record_function``
  that compiled code drops; nothing is profiled here).

Every other warning still shows, from torch or from us. ``GPTLAUNCH_DEBUG=1`` (or
``TORCH_DISTRIBUTED_DEBUG=DETAIL``, which ``launcher submit --debug`` sets on every rank) leaves the
console as torch makes it; so does an explicit ``TORCHINDUCTOR_*`` variable for its own switch.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import warnings
from collections.abc import Mapping

# "1" (or true/yes/on): leave torch's console chatter as torch prints it (Inductor's autotune tables,
# known-harmless internal warnings). TORCH_DISTRIBUTED_DEBUG=DETAIL, which `launcher submit --debug`
# sets, is taken as this request too.
DEBUG_ENV = "GPTLAUNCH_DEBUG"
_TRUE_VALUES = {"1", "true", "yes", "on"}
# warnings.filterwarnings matches ``message`` at the start of the text and ``module`` against the
# module the warning is attributed to: torch's own modules only, so our code would still be told.
TYPED_STORAGE_MESSAGE = r"TypedStorage is deprecated"
TORCH_MODULES = r"torch\."
# Dynamo's warning_once lines (torch/_dynamo/variables/ctx_manager.py and torch.py), by logger.
PROFILER_IGNORED = re.compile(r"Profiler (record )?function .* will be ignored")
PROFILER_LOGGERS = ("torch._dynamo.variables.ctx_manager", "torch._dynamo.variables.torch")
# Inductor config attribute -> (the environment variable it is read from, its quiet value).
INDUCTOR_QUIET = {
    "autotune_num_choices_displayed": ("TORCHINDUCTOR_AUTOTUNE_NUM_CHOICES_DISPLAYED", 0),
    "max_autotune_report_choices_stats": ("TORCHINDUCTOR_MAX_AUTOTUNE_REPORT_CHOICES_STATS", False),
}


def debug_requested(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the console should keep torch's chatter: GPTLAUNCH_DEBUG true, or
    TORCH_DISTRIBUTED_DEBUG=DETAIL (someone is debugging the distributed run: show everything)."""
    if environ.get(DEBUG_ENV, "").strip().lower() in _TRUE_VALUES:
        return True
    return environ.get("TORCH_DISTRIBUTED_DEBUG", "").strip().upper() == "DETAIL"


def quiet_torch_chatter(*, compiling: bool, environ: Mapping[str, str] = os.environ) -> bool:
    """Silence the known-harmless torch warnings and, when ``compiling``, Inductor's autotune tables
    (see the module docstring) unless ``environ`` asks for debug output. Call once, before anything
    compiles. Returns whether it silenced them (False in debug mode)."""
    if debug_requested(environ):
        return False
    warnings.filterwarnings(
        "ignore", message=TYPED_STORAGE_MESSAGE, category=UserWarning, module=TORCH_MODULES
    )
    for name in PROFILER_LOGGERS:
        logging.getLogger(name).addFilter(_drop_profiler_notice)
    if compiling:  # importing Inductor's config costs a second: only when it will be used
        _quiet_inductor(environ)
    return True


def _drop_profiler_notice(record: logging.LogRecord) -> bool:
    return PROFILER_IGNORED.fullmatch(record.getMessage()) is None


def _quiet_inductor(environ: Mapping[str, str]) -> None:
    # Inductor reads these attributes each time it autotunes: setting them now covers every compile
    # of this process. A user's explicit TORCHINDUCTOR_* value was read at import and is kept.
    import torch._inductor.config as inductor_config

    for attribute, (variable, quiet) in INDUCTOR_QUIET.items():
        if variable not in environ:
            setattr(inductor_config, attribute, quiet)


def warn(message: str) -> None:
    """Print one of our warnings, ``trainer: warning: MESSAGE``, to stderr (the node log and console)."""
    print(f"trainer: warning: {message}", file=sys.stderr, flush=True)
