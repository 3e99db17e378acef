"""The health gate's flags and config keys at the edge: the SSH scheduler's own for `launcher check`,
checked and refused when contradictory, and the former names still read with one warning."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from pydantic import ValidationError

from launcher.cli.flags import _FormerFlag, add_job_flags, build_spec
from launcher.cli.main import main
from launcher.job.spec import JobSpec
from launcher.schedulers.ssh.options import SshOptions
from tests.unit.test_launcher_input import _submit
from tests.unit.test_launcher_input import jobs_root as jobs_root  # a fixture, for these tests too


def test_checks_host_flags_are_the_ssh_schedulers_own(capsys: pytest.CaptureFixture[str]) -> None:
    """``launcher check`` takes the SSH scheduler's host and connection flags, generated from
    ``SshOptions`` as ``submit``'s are: the same names, help and checks, errors naming the flag."""
    with pytest.raises(SystemExit):
        main(["check", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for field in ("hosts", "ssh_opts", "host_key_check", "connect_timeout_s", "max_parallel"):
        assert " ".join(SshOptions.model_fields[field].description.split()) in text, field  # type: ignore[union-attr]
    assert main(["check", "--hosts", "h1;h2"]) == 2
    assert "--hosts: 'h1;h2' is not a host name" in capsys.readouterr().err
    assert main(["check", "--hosts", "h1", "--ssh-connect-timeout-s", "0"]) == 2
    assert "--ssh-connect-timeout-s: Input should be greater than or equal to 1" in capsys.readouterr().err
    assert main(["check"]) == 2 and "give the hosts either as hosts" in capsys.readouterr().err


def test_health_gate_settings_are_checked_at_the_edge(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "--hosts", "h1", "--min-busbw", "2"]) == 2  # before any host is reached
    assert "add --collective" in capsys.readouterr().err
    for bad in (["--compute-s", "-1"], ["--min-busbw", "0"]):
        with pytest.raises(SystemExit) as exit_info:
            main(["check", "--hosts", "h1", "--collective", *bad])
        assert exit_info.value.code == 2
        assert bad[0] in capsys.readouterr().err


def test_submit_refuses_contradictory_or_orphan_gate_settings(jobs_root: Path, capsys) -> None:
    ssh = ["--scheduler", "ssh", "--hosts", "h1", "--dry-run"]
    assert _submit(jobs_root, *ssh, "--health-check", "--health-check-warn") == 2
    assert "keep one" in capsys.readouterr().err
    assert _submit(jobs_root, *ssh, "--min-busbw", "2") == 2
    assert "add --health-check" in capsys.readouterr().err


def _spec_of(*argv: str) -> JobSpec:
    parser = argparse.ArgumentParser()
    add_job_flags(parser)
    return build_spec(parser.parse_args(list(argv)), [])


def _warnings(capsys: pytest.CaptureFixture[str]) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if "warning" in line]


def test_former_health_check_flags_still_work_and_warn_once(capsys: pytest.CaptureFixture[str]) -> None:
    ssh = ("--scheduler", "ssh", "--hosts", "h1")
    opts = _spec_of(*ssh, "--preflight", "--preflight").options(SshOptions)
    assert opts.health_check and not opts.health_check_warn
    assert _warnings(capsys) == ["launcher: warning: --preflight is deprecated: use --health-check"]
    opts = _spec_of(*ssh, "--preflight-warn").options(SshOptions)
    assert opts.health_check_warn and not opts.health_check
    assert _warnings(capsys) == ["launcher: warning: --preflight-warn is deprecated: use --health-check-warn"]
    assert not _spec_of(*ssh, "--health-check", "--no-preflight").options(SshOptions).health_check
    assert _warnings(capsys) == ["launcher: warning: --no-preflight is deprecated: use --no-health-check"]
    assert _spec_of(*ssh, "--health-check").options(SshOptions).health_check
    assert _warnings(capsys) == []


def test_a_former_flag_of_any_kind_reads_as_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    """``Flag(renamed_from=...)`` is open to plugin schedulers: a renamed field need not be a boolean."""
    parser = argparse.ArgumentParser()
    action = parser.add_argument("--max-parallel", dest="n", type=int)
    parser.add_argument("--parallel", dest="n", action=_FormerFlag, current=action)
    assert parser.parse_args(["--parallel", "3"]).n == 3
    assert _warnings(capsys) == ["launcher: warning: --parallel is deprecated: use --max-parallel"]


def test_submit_help_shows_only_the_health_check_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["submit", "--scheduler", "ssh", "--help"])
    out = capsys.readouterr().out
    assert "--health-check" in out and "--health-check-warn" in out
    assert "--preflight" not in out and "preflight_warn" not in out


def test_former_health_check_config_keys_still_work_and_warn_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "job.yaml"
    cfg.write_text("scheduler:\n  kind: ssh\n  hosts: [h1]\n  preflight_warn: true\n")
    assert _spec_of("--config", str(cfg)).options(SshOptions).health_check_warn
    assert _warnings(capsys) == [
        f"launcher: warning: scheduler.preflight_warn in --config {cfg} is deprecated: "
        "use scheduler.health_check_warn"
    ]
    cfg.write_text("scheduler:\n  kind: ssh\n  hosts: [h1]\n  preflight: true\n")  # a flag overrides it
    assert not _spec_of("--config", str(cfg), "--no-health-check").options(SshOptions).health_check
    assert len(_warnings(capsys)) == 1


def test_job_record_written_before_the_health_check_rename_still_reads(
    capsys: pytest.CaptureFixture[str],
) -> None:
    spec = JobSpec.model_validate({"scheduler": {"kind": "ssh", "hosts": ["h1"], "preflight": True}})
    assert spec.options(SshOptions).health_check
    assert capsys.readouterr().err == ""  # silently: only what a user types is warned about
    with pytest.raises(ValidationError, match="keep health_check"):
        JobSpec.model_validate({"scheduler": {"kind": "ssh", "preflight": True, "health_check": True}})
