"""What an unknown argument of a launcher command gets: the flag it most likely meant (another tool's
spelling, a near-miss), or where it goes (after ``--``, for the program's and the trainer's flags)."""

from __future__ import annotations

import argparse
import difflib

# Other tools' spellings of a launcher flag (SLURM's sbatch/srun, torchrun's), where they differ by more
# than a typo. torchrun's --nnodes and --nproc_per_node are accepted as they are.
SPELLINGS = {
    "-N": "--nodes",
    "--ntasks-per-node": "--gpus-per-node",
    "--gres": "--gpus-per-node",
    "--gpus": "--gpus-per-node",
    "-J": "--name",
    "--job-name": "--name",
    "-p": "--partition",
    "-t": "--time",
    "-A": "--account",
    "-q": "--qos",
    "-C": "--constraint",
    "-c": "--cpus-per-task",
    "-w": "--slurm-opt nodelist=HOSTS",
    "--nodelist": "--slurm-opt nodelist=HOSTS",
    "-x": "--slurm-opt exclude=HOSTS",
    "--exclude": "--slurm-opt exclude=HOSTS",
    "--master-addr": "--rdzv-endpoint",
    "--master-port": "--rdzv-port",
    "--standalone": "--nodes 1",
}
CLOSE = 0.8  # difflib's ratio from which a flag is offered as the one meant (--nodse -> --nodes)


def unknown_arguments(top: argparse.ArgumentParser, command: str, extras: list[str]) -> str:
    """The error for ``extras``, arguments of ``launcher COMMAND`` that its parser does not know: each
    flag with the one it likely meant, or where it and what follows it go (a flag of ``top``, the
    ``launcher`` parser itself, before the command)."""
    commands = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    known = [flag for action in commands.choices[command]._actions for flag in action.option_strings]
    launcher_flags = {flag for action in top._actions for flag in action.option_strings}
    lines = [f"unrecognized arguments: {' '.join(extras)}"]
    program = command in ("submit", "render")
    for k, arg in enumerate(extras):
        name = arg.split("=", 1)[0]
        meant = _meant(name, known) if name.startswith("-") else None
        if name in launcher_flags:
            lines.append(f"  {name} goes before the command: launcher {name} ... {command} ...")
        elif meant is not None:
            lines.append(f"  {arg}: did you mean {meant}?")
        elif program and (k == 0 or name.startswith("-")):  # not the value of an unknown flag
            rest = " ".join(extras[k:])
            lines.append(
                f"  your program and its flags, or the built-in trainer's, go after --: "
                f"launcher {command} [options] -- {rest}"
            )
            break
    return "\n".join(lines)


def _meant(name: str, known: list[str]) -> str | None:
    """The launcher flag that ``name`` likely means: another tool's spelling, ``_`` for ``-``, or a
    near-miss; None when none is close."""
    dashed = name.replace("_", "-")
    if (spelled := SPELLINGS.get(name) or SPELLINGS.get(dashed)) is not None:
        return spelled
    if dashed in known:
        return dashed
    close = difflib.get_close_matches(name, known, n=1, cutoff=CLOSE)
    return close[0] if close else None
