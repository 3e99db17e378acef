"""Job flags and config files -> a validated JobSpec.

Each flag names a JobSpec field; its type, choices and help (description and default) come from the
field itself, so the models are the one source of what a job accepts. Flags given on the command
line override the config file; flags not given leave it alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import types
from collections.abc import Collection
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from launcher.cli.program import add_resume_flag, set_program
from launcher.job.console import say
from launcher.job.options import Flag, renamed_fields
from launcher.job.registry import DEFAULT_KIND, options_models, scheduler_kinds
from launcher.job.spec import DEFAULT_SECRETS, JobSpec, SpecError

NETWORK_GROUP = "network (environment of every node)"
# The JobSpec's own fields: (flags, dotted field, argument group; "job": the command's own). Each
# scheduler's flags are generated from its options model (``scheduler_flags``).
FLAGS: list[tuple[tuple[str, ...], str, str]] = [
    (("--scheduler",), "scheduler.kind", "job"),
    (("--nodes",), "nnodes", "job"),
    (("--nproc-per-node", "--gpus-per-node"), "nproc_per_node", "job"),
    (("--name",), "name", "job"),
    (("--job-dir",), "job_dir", "job"),
    (("--workdir",), "workdir", "job"),
    (("--python",), "python", "job"),
    (("--omp-num-threads",), "omp_num_threads", "job"),
    (("--grace-period-s",), "grace_period_s", "job"),
    (("--hang-timeout-s",), "hang.timeout_s", "hang watchdog"),
    (("--hang-startup-s",), "hang.startup_s", "hang watchdog"),
    (("--hang-phase-s",), "hang.phase_s", "hang watchdog"),
    (("--retries",), "retries", "recovery"),
    (("--retry-backoff-s",), "retry_backoff_s", "recovery"),
    (("--allow-start-over",), "allow_start_over", "recovery"),
    (("--rdzv-backend",), "rendezvous.backend", "rendezvous"),
    (("--rdzv-endpoint",), "rendezvous.endpoint", "rendezvous"),
    (("--rdzv-port",), "rendezvous.port", "rendezvous"),
    (("--rdzv-id",), "rendezvous.id", "rendezvous"),
    (("--rdzv-join-timeout-s",), "rendezvous.join_timeout_s", "rendezvous"),
    (("--rdzv-last-call-timeout-s",), "rendezvous.last_call_timeout_s", "rendezvous"),
    (("--max-restarts",), "rendezvous.max_restarts", "rendezvous"),
    (("--nccl-socket-ifname",), "network.nccl_socket_ifname", NETWORK_GROUP),
    (("--gloo-socket-ifname",), "network.gloo_socket_ifname", NETWORK_GROUP),
    (("--nccl-ib-disable",), "network.nccl_ib_disable", NETWORK_GROUP),
    (("--nccl-debug",), "network.nccl_debug", NETWORK_GROUP),
    (("--debug",), "network.debug", NETWORK_GROUP),
]
# torchrun's spellings of a flag, accepted as they are and left out of --help.
ALIASES = {"--nodes": ("--nnodes",), "--nproc-per-node": ("--nproc_per_node",)}


class UsageError(Exception):
    """Bad input; the message names the field and the fix."""


def _members(annotation: Any) -> list[Any]:
    """The types of an annotation: ``int | None`` -> [int]; Annotated unions unwrapped."""
    if get_origin(annotation) is not None and hasattr(annotation, "__metadata__"):  # Annotated
        annotation = get_args(annotation)[0]
    if get_origin(annotation) in (Union, types.UnionType):
        return [a for a in get_args(annotation) if a is not type(None)]
    return [annotation]


def field_info(dotted: str, model: type[BaseModel] = JobSpec) -> FieldInfo:
    """The FieldInfo of a dotted JobSpec field, e.g. "rendezvous.port" (through unions of models)."""
    head, _, rest = dotted.partition(".")
    info = model.model_fields[head]
    if not rest:
        return info
    key = rest.split(".")[0]
    models = [m for m in _members(info.annotation) if isinstance(m, type) and issubclass(m, BaseModel)]
    return field_info(rest, next(m for m in models if key in m.model_fields))


def _help(info: FieldInfo) -> str:
    text = info.description or ""
    default = info.get_default(call_default_factory=True)
    if default not in (None, "") and "(default" not in text:
        text += f" (default: {getattr(default, 'value', default)})"
    return text


@dataclasses.dataclass
class JobFlag:
    """A flag generated from a JobSpec field: one of ``FLAGS``, or a field of one or more schedulers'
    options models (the same name for the same field). ``declared``: what the field's ``Flag``
    (``launcher.job.options``) says of its group, metavar, split and former name; one of ``FLAGS``
    has only its group, the --help section."""

    flags: tuple[str, ...]  # its spellings in --help, the first its name
    dest: str  # the dotted JobSpec field: "rendezvous.port", "scheduler.time"
    info: FieldInfo
    declared: Flag
    kinds: list[str] = dataclasses.field(default_factory=list)  # the schedulers that have it; []: every job

    @property
    def flag(self) -> str:
        return self.flags[0]

    @property
    def field(self) -> str:
        """The field of its own model: "port" of "rendezvous.port"."""
        return self.dest.rsplit(".", 1)[-1]

    @property
    def group_title(self) -> str:
        if not self.kinds:
            return self.declared.group or "job"
        kinds = ", ".join(self.kinds[:-1]) + " or " + self.kinds[-1] if len(self.kinds) > 1 else self.kinds[0]
        return f"{self.declared.group or kinds} (with --scheduler {kinds})"


@functools.cache
def job_flags() -> tuple[JobFlag, ...]:
    """Every flag of a job: the JobSpec's own (``FLAGS``), then every scheduler's."""
    own = [JobFlag(flags, dotted, field_info(dotted), Flag(group=title)) for flags, dotted, title in FLAGS]
    return (*own, *scheduler_flags().values())


def scheduler_flags() -> dict[str, JobFlag]:
    """Every registered scheduler's flags by name: ``--<field-name>`` unless the field's ``Flag(...)``
    says otherwise (``launcher.job.options.Flag``). A flag shared by several schedulers is one flag."""
    flags: dict[str, JobFlag] = {}
    for kind, model in options_models().items():
        for name, info in model.model_fields.items():
            declared = Flag.of(info)
            if name == "kind" or declared.name is None:
                continue
            flag = declared.name or "--" + name.replace("_", "-")
            if flag in flags:
                assert flags[flag].field == name, f"{flag} names two fields: {flags[flag].field}, {name}"
                flags[flag].kinds.append(kind)
                continue
            flags[flag] = JobFlag((flag,), f"scheduler.{name}", info, declared, [kind])
    return flags


class _FormerFlag(argparse.Action):
    """A flag's former spelling (``Flag(renamed_from=...)``), hidden from --help: says on stderr, once,
    that it is deprecated, then does what the flag does (``--no-`` form included)."""

    def __init__(self, option_strings: list[str], dest: str, current: argparse.Action) -> None:
        super().__init__(
            option_strings,
            dest,
            nargs=current.nargs,
            default=argparse.SUPPRESS,
            choices=current.choices,
            help=argparse.SUPPRESS,
            metavar=current.metavar,
        )
        self.type = current.type  # the value is converted as the flag's own
        self.current = current
        self.warned = False

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        new = self.current.option_strings[0]
        if option_string and option_string.startswith("--no-"):
            new = "--no-" + new.removeprefix("--")
        if not self.warned:
            say(f"launcher: warning: {option_string} is deprecated: use {new}")
            self.warned = True
        self.current(parser, namespace, values, new)


def argument(flag: JobFlag) -> dict[str, Any]:
    """argparse keywords for a flag: typed, with choices and help from its field; a list or mapping
    flag without ``split`` repeats (one item each)."""
    (kind,) = _members(flag.info.annotation)
    kw: dict[str, Any] = {"dest": flag.dest, "default": argparse.SUPPRESS, "help": _help(flag.info)}
    if kind is bool:
        kw["action"] = argparse.BooleanOptionalAction
    elif get_origin(kind) is Literal:
        kw["choices"] = list(get_args(kind))
    elif get_origin(kind) in (list, dict):
        kw["metavar"] = flag.declared.metavar
        if not flag.declared.split:
            kw["action"] = "append"
    else:
        kw["type"] = kind
        kw["metavar"] = flag.declared.metavar or flag.field.upper()
    return kw


def add_job_flags(parser: argparse.ArgumentParser, shown: Collection[str] | None = None) -> None:
    """Add every flag of ``job_flags``, typed and documented from its field. ``shown``: the schedulers
    whose own flags --help lists (None: every one); the others' are accepted all the same (a config
    file may name the scheduler)."""
    parser.add_argument("--config", type=Path, help="job config file (YAML; fields below); flags override it")
    groups: dict[str, Any] = {"job": parser}
    for flag in job_flags():
        kw = argument(flag)
        if flag.dest == "scheduler.kind":  # the union's tag; the spec names the choices on a bad one
            kw = {k: v for k, v in kw.items() if k != "choices"} | {"metavar": "NAME", "type": str}
            kw["help"] = f"where the job runs: {', '.join(scheduler_kinds())} (default: {DEFAULT_KIND})"
        if shown is not None and flag.kinds and not set(flag.kinds) & set(shown):
            kw["help"] = argparse.SUPPRESS
        if flag.group_title not in groups:
            groups[flag.group_title] = parser.add_argument_group(flag.group_title)
        action = groups[flag.group_title].add_argument(*flag.flags, **kw)
        if flag.flag in ALIASES:
            hidden = {"default": argparse.SUPPRESS, "help": argparse.SUPPRESS, "metavar": action.metavar}
            parser.add_argument(*ALIASES[flag.flag], dest=action.dest, type=action.type, **hidden)
        if old := flag.declared.renamed_from:  # the field's former name: a hidden deprecated alias
            former = ["--" + old.replace("_", "-")]
            if isinstance(action, argparse.BooleanOptionalAction):
                former.append("--no-" + old.replace("_", "-"))
            parser.add_argument(*former, dest=flag.dest, action=_FormerFlag, current=action)
    parser.add_argument(
        "--secret-env",
        action="append",
        default=[],
        metavar="NAME",
        help="one more secret environment variable (repeatable; HF_TOKEN and WANDB_API_KEY are): "
        "passed from this shell to the job at run time, never written down",
    )
    add_resume_flag(parser)
    groups[NETWORK_GROUP].add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra environment variable for every process (repeatable); OMP_NUM_THREADS and "
        "CUDA_VISIBLE_DEVICES here are honoured as the job's thread count and GPU list",
    )


def _set(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for key in parents:
        if isinstance(tree.get(key), str):  # `scheduler: local` in a file, then a nested flag
            tree[key] = {"kind": tree[key]}
        tree = tree.setdefault(key, {})
        if not isinstance(tree, dict):
            raise UsageError(f"{key} in --config must be a mapping of fields (see `launcher submit --help`)")
    tree[leaf] = value


def load_config(path: Path) -> dict[str, Any]:
    """The mapping in a YAML job config. Raises UsageError for a missing, non-UTF-8 or non-YAML file."""
    import yaml  # here, not at the top: the quick commands (status, cancel, ...) never need it

    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise UsageError(f"--config {path}: {e.strerror}; check the path") from None
    except UnicodeDecodeError:
        raise UsageError(f"--config {path} is not UTF-8 text: save it as UTF-8") from None
    except yaml.YAMLError as e:
        raise UsageError(f"--config {path} is not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UsageError(f"--config {path} must hold a mapping of job fields (see `launcher submit --help`)")
    return data


def build_spec(args: argparse.Namespace, trainer_args: list[str]) -> JobSpec:
    """Config file, then flags, then trainer arguments -> validated JobSpec. Raises UsageError."""
    tree = load_config(args.config) if args.config else {}
    if args.config:
        _rename_former_keys(tree, args.config)
    for flag in job_flags():
        if hasattr(args, flag.dest):
            set_flag(tree, flag, getattr(args, flag.dest))
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep:
            raise UsageError(f"--env {item!r}: use KEY=VALUE")
        _set(tree, f"network.env.{key}", value)
    if getattr(args, "sweep_id", None):  # a sweep's run (``launcher.cli.sweeps``)
        tree["sweep_id"] = args.sweep_id
    if args.secret_env:
        from_file = tree.get("secret_env", list(DEFAULT_SECRETS))
        if not isinstance(from_file, list):
            raise UsageError("secret_env in --config must be a list of names, e.g. [HF_TOKEN, MY_KEY]")
        tree["secret_env"] = [*from_file, *args.secret_env]
    try:
        trainer_args = set_program(tree, list(trainer_args), args.resume_args)
    except SpecError as e:
        raise UsageError(str(e)) from None
    if trainer_args:
        from_file = tree.get("trainer_args", [])
        if not isinstance(from_file, list):
            raise UsageError("trainer_args in --config must be a list of strings, e.g. [--max-steps, '100']")
        tree["trainer_args"] = [*from_file, *trainer_args]
    try:
        return JobSpec.model_validate(tree)
    except ValidationError as e:
        raise UsageError(_describe(e, args.config)) from None


def _rename_former_keys(tree: dict[str, Any], config: Path) -> None:
    """Scheduler options under a former name in a config file: renamed, each with a deprecation
    warning (before the flags, which override them). Both names given: the spec says to keep one."""
    options = tree.get("scheduler")
    kind = options.get("kind", DEFAULT_KIND) if isinstance(options, dict) else None
    model = options_models().get(kind) if isinstance(kind, str) else None
    if not isinstance(options, dict) or model is None:
        return  # no options, or a bad kind, which the spec names
    for old, new in renamed_fields(model).items():
        if old in options and new not in options:
            say(f"launcher: warning: scheduler.{old} in --config {config} is deprecated: use scheduler.{new}")
            options[new] = options.pop(old)


def set_flag(tree: dict[str, Any], flag: JobFlag, value: Any) -> None:
    """A flag's value into the config tree: a separated list split, each ``KEY[=VALUE]`` of a
    mapping flag merged into the mapping of the config file, anything else as given."""
    if flag.declared.split:
        value = [v.strip() for v in value.split(flag.declared.split) if v.strip()]
    elif get_origin(_members(flag.info.annotation)[0]) is dict:
        for item in value:
            key, _, item_value = item.partition("=")
            _set(tree, f"{flag.dest}.{key.removeprefix('--')}", item_value)
        return
    _set(tree, flag.dest, value)


def _extra_hint(parts: list[str]) -> str:
    """What to do about an unknown field: an option of another scheduler says which."""
    if parts[:1] == ["scheduler"] and len(parts) > 1:
        models = options_models()
        owners = [kind for kind, m in models.items() if parts[1] in {*m.model_fields, *renamed_fields(m)}]
        if owners:
            return f"; it is an option of --scheduler {', '.join(owners)}"
    return "; remove it or check the spelling"


def flag_name(kind: str | None, dotted: str) -> str | None:
    """The flag of field ``dotted`` ("rendezvous.port", "scheduler.time") in a job of scheduler
    ``kind``, if it has one."""
    for flag in job_flags():
        if flag.dest == dotted and (not flag.kinds or kind in flag.kinds):
            return flag.flag
    return None


def _describe(e: ValidationError, config: Path | None) -> str:
    lines = ["invalid job spec:"]
    for err in e.errors():
        # Drop list indexes and the union's tag ("scheduler.local.gpus" -> "scheduler.gpus").
        parts = [str(x) for x in err["loc"] if not isinstance(x, int)]
        kind = parts.pop(1) if parts[:1] == ["scheduler"] and len(parts) > 1 else None
        field = ".".join(parts)
        flag = flag_name(kind, field) or flag_name(kind, f"{field}.kind")
        where = f"{field} ({flag})" if flag else field or "job spec"
        shown = err["type"] != "missing" and not isinstance(err["input"], dict)
        got = f" (got {err['input']!r})" if shown else ""
        hint = _extra_hint(parts) if err["type"] == "extra_forbidden" else ""
        lines.append(f"  {where}: {err['msg'].removeprefix('Value error, ')}{got}{hint}")
    if config:
        lines.append(f"  (fields from --config {config} or the flags; see `launcher submit --help`)")
    return "\n".join(lines)
