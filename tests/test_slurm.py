"""``torchmp run`` in a Slurm allocation, with environment fixtures (no
Slurm here): host lists expanded as Slurm does, the job's shape derived when
the user gave none of it, printed, and a malformed variable a usage error
before anything starts."""
from __future__ import annotations

import os
import sys

import pytest

from torchmp import _slurm
from torchmp._slurm import SlurmError, allocation, count_hosts, expand_hostlist, first_host

from helpers import Launchers, wait_no_tagged


@pytest.mark.parametrize("text, hosts", [
    ("gpu[01-04,07],cpu3", ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07", "cpu3"]),
    ("node7", ["node7"]),
    ("a,b c", ["a", "b", "c"]),
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),          # width of the first number: no padding
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ("rack[1-2]-n[08-09]", ["rack1-n08", "rack1-n09", "rack2-n08", "rack2-n09"]),
    ("x[3]y", ["x3y"]),
    ("  gpu[1-2]\n", ["gpu1", "gpu2"]),
    ("dgx-a100-[0007,0010]", ["dgx-a100-0007", "dgx-a100-0010"]),
])
def test_expand_hostlist(text, hosts):
    assert expand_hostlist(text) == hosts
    assert first_host(text) == hosts[0]
    assert count_hosts(text) == len(hosts)


@pytest.mark.parametrize("text, needle", [
    ("gpu[01-04", "'[' without ']'"),
    ("gpu01]", "']' without '['"),
    ("gpu[]", "empty []"),
    ("gpu[a-b]", "holds 'a-b', which is not a number"),
    ("gpu[1-]", "holds '1-'"),
    ("gpu[4-1]", "the range '4-1' in [4-1] runs backwards"),
    ("gpu[1-2-3]", "holds '1-2-3'"),
    ("gpu[[1]]", "nested '['"),
    ("a,,b", "empty host name"),
    ("", "is empty"),
    ("gpu[1,]", "holds ''"),
])
def test_malformed_hostlists(text, needle):
    with pytest.raises(SlurmError, match=f"L.*{_re(needle)}"):
        expand_hostlist(text, "L")
    with pytest.raises(SlurmError):
        first_host(text, "L")


def _re(text: str) -> str:
    import re
    return re.escape(text)


def test_huge_ranges_are_counted_not_expanded():
    text = "n[0000000-9999999]"
    assert first_host(text) == "n0000000"
    assert count_hosts(text) == 10_000_000
    with pytest.raises(SlurmError, match="more than 65536 hosts"):
        expand_hostlist(text)


JOB = {
    "SLURM_JOB_ID": "4242137",
    "SLURM_NNODES": "4",
    "SLURM_NODEID": "2",
    "SLURM_JOB_NODELIST": "gpu[01-04,07],cpu3",
}


def test_allocation_outside_slurm():
    assert allocation({}, rendezvous=True, nproc=True) is None
    assert allocation({"SLURM_NNODES": "4"}, rendezvous=True, nproc=True) is None


def test_allocation_multi_node():
    alloc = allocation({**JOB, "SLURM_GPUS_ON_NODE": "8", "SLURM_NTASKS_PER_NODE": "1"},
                       rendezvous=True, nproc=True)
    assert (alloc.nnodes, alloc.node_rank, alloc.master_addr, alloc.master_port, alloc.nproc) == (
        4, 2, "gpu01", 15000 + 2137, 8)
    assert alloc.describe() == (
        "Slurm job 4242137: -n 8 (SLURM_GPUS_ON_NODE), --nnodes 4 (SLURM_NNODES), --node-rank 2 "
        "(SLURM_NODEID), --master-addr gpu01 (first host of SLURM_JOB_NODELIST), --master-port 17137 "
        "(SLURM_JOB_ID)")


def test_allocation_prefers_the_steps_node_list():
    alloc = allocation({**JOB, "SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_STEP_NODELIST": "gpu[03-04]"},
                       rendezvous=True, nproc=False)
    assert (alloc.nnodes, alloc.node_rank, alloc.master_addr) == (2, 1, "gpu03")


def test_allocation_parts():
    alloc = allocation({**JOB, "SLURM_NTASKS_PER_NODE": "3"}, rendezvous=False, nproc=True)
    assert (alloc.nproc, alloc.nnodes, alloc.master_addr) == (3, None, None)
    alloc = allocation(JOB, rendezvous=True, nproc=False)
    assert alloc.nproc is None and alloc.nnodes == 4
    # One node: nothing to meet on but this host (a free port, 127.0.0.1).
    alloc = allocation({**JOB, "SLURM_NNODES": "1", "SLURM_NODEID": "0"}, rendezvous=True, nproc=False)
    assert (alloc.nnodes, alloc.node_rank, alloc.master_addr, alloc.master_port) == (1, 0, None, None)


@pytest.mark.parametrize("changes, needle", [
    ({"SLURM_JOB_NODELIST": "gpu[01-"}, "SLURM_JOB_NODELIST='gpu[01-': '[' without ']' in 'gpu[01-'"),
    ({"SLURM_JOB_NODELIST": "gpu[01-02]"}, "names fewer hosts than SLURM_NNODES=4"),
    ({"SLURM_JOB_NODELIST": None}, "SLURM_JOB_NODELIST is not set"),
    ({"SLURM_NNODES": "four"}, "SLURM_NNODES='four' is not a positive integer"),
    ({"SLURM_NNODES": "0"}, "SLURM_NNODES='0' is not a positive integer"),
    ({"SLURM_NNODES": None}, "SLURM_JOB_ID is set but SLURM_NNODES is not"),
    ({"SLURM_NODEID": None}, "SLURM_NODEID is not set"),
    ({"SLURM_NODEID": "4"}, "SLURM_NODEID=4 is not below SLURM_NNODES=4"),
    ({"SLURM_NODEID": "-1"}, "SLURM_NODEID='-1' is not an integer >= 0"),
    ({"SLURM_JOB_ID": "12_3"}, "SLURM_JOB_ID='12_3' is not a number"),
    ({"SLURM_GPUS_ON_NODE": "0"}, "SLURM_GPUS_ON_NODE='0' is not a positive integer"),
])
def test_allocation_errors(changes, needle):
    env = dict(JOB)
    for key, value in changes.items():
        if value is None:
            env.pop(key)
        else:
            env[key] = value
    with pytest.raises(SlurmError, match=_re(needle)):
        allocation(env, rendezvous=True, nproc=True)


def test_port_range():
    ports = {allocation({**JOB, "SLURM_JOB_ID": str(j)}, rendezvous=True, nproc=False).master_port
             for j in (1, 9999, 10000, 123456789)}
    assert ports == {15001, 24999, 15000, 21789}
    assert all(_slurm.PORT_BASE <= p < 32768 for p in ports)  # below Linux's ephemeral ports


# ---------------------------------------------------------------------------
# torchmp run


@pytest.fixture
def cli():
    """Run ``torchmp run ARGS`` with exactly the SLURM_* variables given."""
    with Launchers(trailing_pathsep=True) as launchers:
        def run(*args: str, env: dict[str, str] | None = None, timeout: float = 30):
            unset = [k for k in os.environ if k.startswith("SLURM_")] + ["TORCHELASTIC_SIGNALS_TO_HANDLE"]
            launched = launchers.start([sys.executable, "-m", "torchmp", "run", *args], env=env, unset=unset)
            result = launched.communicate(timeout)
            assert wait_no_tagged(launched.tag) == []
            return result

        yield run


PRINT_ENV = ["--", "sh", "-c", 'echo "$RANK $LOCAL_RANK $WORLD_SIZE $MASTER_ADDR:$MASTER_PORT $GROUP_RANK"']


def test_run_takes_the_job_from_slurm(cli, tmp_path):
    env = {**JOB, "SLURM_GPUS_ON_NODE": "2"}
    code, out, err = cli("--no-summary", "--log-dir", str(tmp_path), *PRINT_ENV, env=env)
    assert code == 0, err
    assert sorted(out.splitlines()) == ["[sh4]:4 0 8 gpu01:17137 2", "[sh5]:5 1 8 gpu01:17137 2"]
    assert err.splitlines()[0] == (
        "torchmp: Slurm job 4242137: -n 2 (SLURM_GPUS_ON_NODE), --nnodes 4 (SLURM_NNODES), --node-rank 2 "
        "(SLURM_NODEID), --master-addr gpu01 (first host of SLURM_JOB_NODELIST), --master-port 17137 "
        "(SLURM_JOB_ID)")


def test_run_single_node_job_meets_locally(cli, tmp_path):
    env = {**JOB, "SLURM_NNODES": "1", "SLURM_NODEID": "0", "SLURM_NTASKS_PER_NODE": "2"}
    code, out, err = cli("--no-summary", "--log-dir", str(tmp_path), *PRINT_ENV, env=env)
    assert code == 0, err
    lines = sorted(out.splitlines())
    assert [line.split()[:3] for line in lines] == [["[sh0]:0", "0", "2"], ["[sh1]:1", "1", "2"]]
    assert {line.split()[3].split(":")[0] for line in lines} == {"127.0.0.1"}
    assert err.splitlines()[0] == ("torchmp: Slurm job 4242137: -n 2 (SLURM_NTASKS_PER_NODE), "
                                   "--nnodes 1 (SLURM_NNODES)")


def test_user_options_win_over_the_job(cli, tmp_path):
    env = {**JOB, "SLURM_GPUS_ON_NODE": "8"}
    code, out, err = cli("-n", "1", "--master-port", "29999", "--no-summary", "--log-dir", str(tmp_path),
                         *PRINT_ENV, env=env)
    assert code == 0, err
    # A rendezvous option given: none of them is taken from the job; -n given: neither is it.
    assert out.splitlines() == ["[sh0]:0 0 1 127.0.0.1:29999 0"]
    assert "Slurm" not in err
    code, out, err = cli("--no-slurm", "-n", "1", "--no-summary", "--log-dir", str(tmp_path), *PRINT_ENV,
                         env={**JOB, "SLURM_JOB_NODELIST": "gpu[01-"})
    assert code == 0, err
    assert out.split()[:3] == ["[sh0]:0", "0", "1"] and "Slurm" not in err


@pytest.mark.parametrize("changes, message", [
    ({"SLURM_JOB_NODELIST": "gpu[01-04,07"},
     "Slurm: SLURM_JOB_NODELIST='gpu[01-04,07': '[' without ']' in 'gpu[01-04,07' (or --no-slurm to ignore "
     "the job)"),
    ({"SLURM_NTASKS_PER_NODE": "x"}, "Slurm: SLURM_NTASKS_PER_NODE='x' is not a positive integer"),
])
def test_run_malformed_job_is_a_usage_error(cli, tmp_path, changes, message):
    marker = tmp_path / "started"
    code, out, err = cli("--log-dir", str(tmp_path / "logs"), "--", "touch", str(marker), env={**JOB, **changes})
    assert code == 2
    assert f"torchmp run: error: {message}" in err
    assert out == "" and not marker.exists() and not (tmp_path / "logs").exists()


def test_run_needs_n_when_the_job_does_not_say(cli, tmp_path):
    code, out, err = cli("--", "true", env=JOB)
    assert code == 2 and "the following arguments are required: -n/--nproc" in err
