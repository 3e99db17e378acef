"""SSH scheduler inputs and rendering, without hosts: hostfile parsing, host name and option checks,
the ssh command line, and the Plan a node runs (quoted for the remote shell)."""

from __future__ import annotations

import shlex
import stat
from pathlib import Path

import pytest

from launcher.agent.private import UnsafeDirError, private_dir
from launcher.cli.main import main
from launcher.job.failures import killed_by
from launcher.job.measurements import Probe, Route
from launcher.job.spec import JobSpec, Program, SpecError
from launcher.job.torchrun import zygote_name
from launcher.schedulers.ssh.client import Host, SshSettings, check_host, explain_ssh_failure, parse_hostfile
from launcher.schedulers.ssh.copies import rsync_argv
from launcher.schedulers.ssh.hosts import choose_ifnames, hosts_of
from launcher.schedulers.ssh.options import SshOptions
from launcher.schedulers.ssh.scheduler import SshFacts, SshScheduler


def test_hostfile_lines_comments_and_slots() -> None:
    text = "# cluster\nnode-a slots=8\n\n  node-b   # spare\nuser@10.0.0.3 slots=2\n"
    assert parse_hostfile(text) == [Host("node-a", 8), Host("node-b"), Host("user@10.0.0.3", 2)]


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("a\nb slots=zero\n", "line 2"),
        ("a slots=0\n", "slots=N"),
        ("a\na\n", "listed twice"),
        ("# nothing\n", "lists no host"),
        ("a;rm -rf /\n", "not a host name"),
        ("-oProxyCommand=x\n", "not a host name"),
    ],
)
def test_bad_hostfiles_name_the_problem(text: str, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        parse_hostfile(text)


@pytest.mark.parametrize("name", ["gpu-01", "root@gpu-01.example.com", "10.1.2.3", "my_alias"])
def test_valid_host_names(name: str) -> None:
    assert check_host(name) == name


@pytest.mark.parametrize("name", ["", "-p22", "a b", "a$(x)", "a`x`", "a;b", "a\nb", "[::1]"])
def test_hostile_host_names_are_rejected(name: str) -> None:
    with pytest.raises(ValueError):
        check_host(name)


def test_ssh_options_are_checked() -> None:
    with pytest.raises(ValueError, match="KEY=VALUE"):
        SshOptions(hosts=["a"], ssh_opts=["-F/etc/x"])
    with pytest.raises(ValueError, match="set by the launcher"):
        SshOptions(hosts=["a"], ssh_opts=["StrictHostKeyChecking=no"])
    with pytest.raises(ValueError, match="keep-alives"):
        SshOptions(hosts=["a"], ssh_opts=["ServerAliveInterval=0"])
    with pytest.raises(ValueError, match="either"):
        SshOptions(hosts=["a"], hostfile=Path("h"))


def test_ssh_argv_is_strict_non_interactive_and_multiplexed(tmp_path: Path) -> None:
    settings = SshSettings(options=("Port=2222",), control_dir=tmp_path)
    argv = settings.argv("gpu-01", "echo hi")
    opts = [argv[i + 1] for i, a in enumerate(argv) if a == "-o"]
    assert {"BatchMode=yes", "StrictHostKeyChecking=yes", "ControlMaster=auto", "Port=2222"} <= set(opts)
    assert argv[-3:] == ["--", "gpu-01", "echo hi"]
    other = SshSettings(options=("UserKnownHostsFile=/dev/null",), control_dir=tmp_path).argv("gpu-01", "x")
    path = next(o for o in opts if o.startswith("ControlPath="))
    assert path not in other, "a connection with other options must not reuse this master"


def test_ssh_failures_are_explained() -> None:
    assert "CHANGED" in explain_ssh_failure("h", "@@@ WARNING: REMOTE HOST IDENTIFICATION HAS CHANGED! @@@")
    assert "known_hosts" in explain_ssh_failure("h", "Host key verification failed.")
    assert "unreachable" in explain_ssh_failure("h", "ssh: connect to host h port 22: Connection timed out")


def _probe(address: str, dev: str, interfaces: dict[str, list[str]]) -> Probe:
    return Probe(
        hostname="h", os="Debian", kernel="6", machine="x86_64", python="3.11.7", python_executable="/p",
        torch="2.13.0", torch_git="abc", cuda=None, nccl=None, cudnn=None, driver=None, gpus=[],
        launcher="0.1.0", packages={}, image_digest=None, in_container=False, interfaces=interfaces,
        route=Route(to="m", address=address, dev=dev, src=None), resolved={"m": address}, free_port=None,
        probe_s=0.1,
    )  # fmt: skip


def test_interface_choice_takes_the_route_and_never_lo() -> None:
    probes = {
        "a": _probe("10.0.0.1", "lo", {"lo": ["127.0.0.1"], "ib0": ["10.0.0.1"]}),  # a is the master
        "b": _probe("10.0.0.1", "ib0", {"lo": ["127.0.0.1"], "ib0": ["10.0.0.2"]}),
    }
    assert choose_ifnames(probes, "m", multi_host=True) == {"a": "ib0", "b": "ib0"}
    loopback = {"a": _probe("127.0.1.1", "lo", {"lo": ["127.0.0.1"]})}
    with pytest.raises(SpecError, match="loopback"):
        choose_ifnames(loopback | {"b": probes["b"]}, "m", multi_host=True)


def test_plan_quotes_every_value_for_the_remote_shell() -> None:
    spec = JobSpec.model_validate(
        {
            "scheduler": {"kind": "ssh", "hosts": ["a", "b"]},
            "nnodes": 2,
            "network": {"env": {"NOTE": "it's $(bad)"}},
            "trainer_args": ["--run-dir", "/r/x y/$(touch p)"],
        }
    )
    facts = {
        "workdir": "/w d", "hosts": ["a", "b"], "master_addr": "a", "rdzv_port": 29500,
        "ifnames": {"a": "eth0", "b": "ens5"}, "omp_num_threads": None,
    }  # fmt: skip
    plan = SshScheduler().render(spec, SshFacts(**facts), "job-1", Path("/jobs/job-1"))
    assert [n.env["GLOO_SOCKET_IFNAME"] for n in plan.nodes] == ["eth0", "ens5"]
    line = plan.nodes[1].shell_command()
    words = shlex.split(line)  # what a POSIX shell on the host splits it into
    assert words[:3] == ["cd", "--", "/w d"] and "NOTE=it's $(bad)" in words
    assert "/r/x y/$(touch p)" in words and "--rdzv-endpoint=a:29500" in words
    agent = words.index("launcher.agent")
    assert words[agent + 1 : agent + 6] == [
        "run", "--job", "job-1", "--node", "1",
    ]  # fmt: skip


def test_warm_workers_fork_each_rank_from_the_hosts_abstract_zygote_and_refuse_images_and_binaries() -> None:
    spec = JobSpec.model_validate({"scheduler": {"kind": "ssh", "hosts": ["a"], "warm_workers": True}})
    facts = {
        "workdir": "/w", "hosts": ["a"], "master_addr": "a", "rdzv_port": 29500, "ifnames": {"a": "eth0"},
        "omp_num_threads": None,
    }  # fmt: skip
    words = shlex.split(
        SshScheduler().render(spec, SshFacts(**facts), "job-1", Path("/j")).nodes[0].shell_command()
    )
    tail = words[words.index("gptlaunch.warm") - 1 :]
    assert tail[:5] == ["-m", "gptlaunch.warm", "run", zygote_name("job-1"), "--"], words
    assert tail[5:8] == ["-m", "trainer.cli", "train"]
    assert zygote_name("job-1").startswith("@") and zygote_name("job-1") != zygote_name("job-2")
    with pytest.raises(ValueError, match=r"--warm-workers .* --image"):
        SshOptions(hosts=["a"], warm_workers=True, image="img:1")
    no_python = spec.model_copy(update={"program": Program(kind="no_python", target="./a.out")})
    with pytest.raises(SpecError, match="--warm-workers"):
        SshScheduler().resolve(no_python)


def test_private_dirs_refuse_symlinks_other_modes_and_are_made_0700(tmp_path: Path) -> None:
    made = private_dir(tmp_path / "a" / "b")
    assert stat.S_IMODE(made.stat().st_mode) == 0o700
    (tmp_path / "open").mkdir(mode=0o755)
    (tmp_path / "open").chmod(0o755)
    with pytest.raises(UnsafeDirError, match="mode 0755"):
        private_dir(tmp_path / "open")
    (tmp_path / "link").symlink_to(made)
    with pytest.raises(UnsafeDirError, match="symlink"):
        private_dir(tmp_path / "link")


@pytest.mark.parametrize(("code", "signum"), [(-9, 9), (137, 9), (143, 15), (1, None), (255, None)])
def test_a_killed_agent_is_told_from_an_ssh_failure(code: int, signum: int | None) -> None:
    assert killed_by(code) == signum


def test_zero_nodes_is_a_spec_error() -> None:
    with pytest.raises(SpecError, match="at least one node"):
        hosts_of(SshOptions(hosts=["a"]), 0)


def test_sync_is_rsync_over_the_jobs_own_ssh_settings() -> None:
    settings = SshSettings(options=("ProxyJump=bastion",), host_key_check="accept-new")
    argv = rsync_argv(settings, "gl-h1", "/src", "gl-h1:/work/dir")
    assert argv[:4] == ["rsync", "-a", "--mkpath", "--stats"] and "--delete" not in argv
    assert shlex.split(argv[argv.index("-e") + 1]) == settings.argv("gl-h1", "true")[:-3]
    assert "ProxyJump=bastion" in argv[argv.index("-e") + 1]
    assert argv[-2:] == ["/src/", "gl-h1:/work/dir/"]


def test_a_dry_run_whose_hosts_do_not_resolve_prints_the_plan_marked_and_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The real OpenSSH client: ".invalid" never resolves (RFC 2606), and the failure needs no network.
    hosts = "gl-nowhere-a.invalid,gl-nowhere-b.invalid"
    jobs = tmp_path / "jobs"
    argv = ["--jobs-root", str(jobs), "submit", "--scheduler", "ssh", "--hosts", hosts, "--nodes", "2"]
    code = main([*argv, "--dry-run", "--", "--max-steps", "5"])
    out, err = capsys.readouterr()
    assert code == 2, err
    assert "# node 0 on gl-nowhere-a.invalid (DOES NOT RESOLVE HERE; log: node-0.log)" in out, out
    assert "# node 1 on gl-nowhere-b.invalid (DOES NOT RESOLVE HERE; log: node-1.log)" in out, out
    assert "--rdzv-endpoint=gl-nowhere-a.invalid:29500" in out, out
    assert "2 host(s) do not resolve here: gl-nowhere-a.invalid, gl-nowhere-b.invalid" in err, err
    assert "refuses it until they resolve" in err and "Traceback" not in err, err
    assert not jobs.exists(), "a dry run writes nothing"
    # submit itself refuses the same job before anything is written
    assert main([*argv, "--", "--max-steps", "5"]) == 2
    assert "do not resolve here" in capsys.readouterr().err
    assert not jobs.exists()
