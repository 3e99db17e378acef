"""The trainer's user-facing errors: each message names the problem, the flag and the fix.

``trainer`` exits 2 (EXIT_USAGE) on any of ``USER_ERRORS`` and 1 (EXIT_FAILED) on ``RUN_ERRORS``.
They live in this leaf module (no torch, no other trainer import) so that every layer, from the data
package up to the command line, raises them without importing the layers above it.
"""

from __future__ import annotations


class DataError(ValueError):
    """A user-facing data problem; ``str(e)`` names the problem and the fix."""


class ConfigError(ValueError):
    """A configuration that cannot run here (e.g. a global batch that does not split over the ranks);
    the message names the flag and the fix. The trainer exits 2 on it."""


class UsageError(ValueError):
    """A bad flag value; str() names the flag and the fix."""


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used for this run; the message says why and what to do."""


class TrainingError(RuntimeError):
    """The run cannot continue (e.g. a non-finite loss); the message says what to change."""


class NoSpaceError(RuntimeError):
    """A checkpoint did not fit on the run dir's file system (full, or over the user's quota); the
    message says where, the bytes it needs and those free. The previous checkpoints are whole."""


# Bad input: the trainer exits EXIT_USAGE on these, with the message and no traceback.
USER_ERRORS: tuple[type[Exception], ...] = (UsageError, DataError, CheckpointError, ConfigError)
# The run cannot go on: the trainer exits EXIT_FAILED on these, with the message and no traceback.
RUN_ERRORS: tuple[type[Exception], ...] = (TrainingError, NoSpaceError)
