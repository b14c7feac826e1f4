"""Multi-node torchrun: two 'nodes' on this machine, as two concurrent launches of one job
(c10d at one endpoint, or static ``--node-rank``/``--master-addr``), each node plainly (real
torchrun), through the launcher, or one of each; compared with two real torchruns."""

import json
import os
import re
import textwrap
import threading

import pytest

from conftest import PY, plain

pytestmark = pytest.mark.needs_torch

BIN = os.path.dirname(PY)
TORCHRUN = os.path.join(BIN, "torchrun")

# Each rank meets the others (gloo), then says what torchrun gave it and whether it was forked;
# EXIT_RANK's rank then leaves with status 3 while the others wait for it at a barrier.
NODE = textwrap.dedent("""\
    import json, os, sys
    import torch, torch.distributed as dist
    forked = 'module_table' in repr(sys.meta_path)
    dist.init_process_group("gloo")
    t = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    keys = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE",
            "WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
            "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE", "OMP_NUM_THREADS",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING")
    env = {k: os.environ.get(k) for k in keys}
    os.write(1, ("NODE " + json.dumps({"sum": t.item(), "env": env, "forked": forked}) + "\\n").encode())
    if os.environ["RANK"] == os.environ.get("EXIT_RANK"):
        os._exit(3)
    dist.barrier()
    dist.destroy_process_group()
    """)


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_env(tmp_path, **extra):
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MASTER_PORT")}
    return dict(env, PATH=BIN + os.pathsep + env.get("PATH", ""), TMPDIR=str(tmp_path), **extra)


def run_nodes(launcher, tmp_path, ways, node_args, program=NODE, **extra):
    """Node k of the job, launched ``ways[k]`` ("plain" or "launcher") with ``node_args(k)``,
    all at once; returns each node's (exit code, output, via)."""
    results = [None] * len(ways)

    def node(k):
        args = [TORCHRUN, *node_args(k), "node.py"]
        env, cwd = node_env(tmp_path, **extra), tmp_path
        if ways[k] == "plain":
            ref = plain(args, cwd=cwd, env=env, timeout=120)
            results[k] = (ref.returncode, ref.stdout, "plain")
        else:
            got = launcher.run(args, cwd=cwd, env=env, timeout=120)
            results[k] = (got.returncode, got.stdout, got.via)

    (tmp_path / "node.py").write_text(program)
    threads = [threading.Thread(target=node, args=(k,)) for k in range(len(ways))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def ranks_seen(results, ways):
    """Per node: its ranks' reports, the varying values (port, run id, temporary paths) named;
    and whether each rank was forked as its node's way says."""
    nodes = []
    for (code, output, via), way in zip(results, ways):
        reports = [json.loads(line[5:]) for line in output.splitlines() if line.startswith("NODE ")]
        assert via == ("plain" if way == "plain" else "zygote"), output
        assert all(r.pop("forked") == (way == "launcher") for r in reports), output
        for r in reports:
            r["env"]["MASTER_PORT"] = "PORT" if r["env"]["MASTER_PORT"] else None
            r["env"]["TORCHELASTIC_RUN_ID"] = "ID" if r["env"]["TORCHELASTIC_RUN_ID"] else None
            r["env"]["TORCHELASTIC_ERROR_FILE"] = re.sub(
                r".*/(attempt_\d+/\d+/error.json)$", r"\1", r["env"]["TORCHELASTIC_ERROR_FILE"])
        nodes.append((code, sorted(reports, key=lambda r: int(r["env"]["RANK"]))))
    return nodes


def c10d(port):
    return lambda k: ["--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=c10d",
                      f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=job"]


def static(port):
    return lambda k: ["--nnodes=2", "--nproc-per-node=2", f"--node-rank={k}",
                      "--master-addr=127.0.0.1", f"--master-port={port}"]


@pytest.mark.parametrize("rendezvous", [c10d, static])
def test_two_nodes_match_two_torchruns(torch_launcher, tmp_path, rendezvous):
    """Global ranks, GROUP_RANK, ROLE_*, TORCHELASTIC_* and the meeting, node by node: both
    nodes through the launcher, and one through the launcher beside a plain torchrun."""
    reference = ranks_seen(run_nodes(torch_launcher, tmp_path, ["plain"] * 2,
                                     rendezvous(_free_port())), ["plain"] * 2)
    assert [code for code, _ in reference] == [0, 0], reference
    assert [len(reports) for _, reports in reference] == [2, 2]
    # Mixed nodes: once (c10d), to keep the suite quick.
    for ways in [["launcher", "launcher"]] + [["launcher", "plain"]] * (rendezvous is c10d):
        got = ranks_seen(run_nodes(torch_launcher, tmp_path, ways, rendezvous(_free_port())),
                         ways)
        if rendezvous is c10d:  # c10d numbers the nodes in the order they join
            got.sort(key=lambda node: node[1][0]["env"]["GROUP_RANK"] if node[1] else "")
            reference.sort(key=lambda node: node[1][0]["env"]["GROUP_RANK"])
        assert got == reference, ways


def failure_outcome(results):
    """Each node's exit code and the (rank, exit code) its failure report lists with an exit
    status of its own (not a SIGTERM from its agent). Which of the ranks waiting for rank 3
    ends first, and whether by its lost peer or by its agent's SIGTERM, is a race in torchrun
    too (torch stamps failures to the second); that rank 3 failed with 3 is not."""
    outcome = []
    for code, output, _ in results:
        named = re.findall(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\n\s*exitcode\s*:\s*(\d+)",
                           output)
        outcome.append((code, "3" in dict(named) and dict(named)["3"], "Root Cause" in output))
    return outcome


def test_a_failing_rank_on_node_1_ends_node_0_as_with_torchrun(torch_launcher, tmp_path):
    """Rank 3 (node 1) exits 3 while the others wait for it at a barrier: node 1 reports it,
    node 0's ranks lose their peer and fail, both launches end with torchrun's status."""
    ref = run_nodes(torch_launcher, tmp_path, ["plain"] * 2, static(_free_port()), EXIT_RANK="3")
    theirs = failure_outcome(ref)
    assert theirs == [(1, False, True), (1, "3", True)], ref
    got = run_nodes(torch_launcher, tmp_path, ["launcher"] * 2, static(_free_port()),
                    EXIT_RANK="3")
    assert [via for _, _, via in got] == ["zygote"] * 2, got
    assert failure_outcome(got) == theirs, got


def test_a_node_that_never_arrives_times_out_as_with_torchrun(torch_launcher, tmp_path):
    """One node of two: torch's rendezvous timeout, its message and exit status."""
    def alone(port):
        return lambda k: [*c10d(port)(k), "--rdzv-conf=join_timeout=2,last_call_timeout=1"]

    def outcome(results):
        code, output, _ = results[0]
        errors = [line for line in output.splitlines() if line.startswith("torch.distributed")]
        return code, errors[-1:]
    ref = outcome(run_nodes(torch_launcher, tmp_path, ["plain"], alone(_free_port())))
    assert ref[0] == 1 and "RendezvousTimeoutError" in ref[1][0], ref
    got = run_nodes(torch_launcher, tmp_path, ["launcher"], alone(_free_port()))
    assert got[0][2] == "zygote", got
    assert outcome(got) == ref, got


# Rank 1 (node 1) fails once, before meeting the others, then succeeds on its node's restart.
FLAKY = textwrap.dedent("""\
    import os, sys
    e = os.environ
    mark = os.path.join(e["MARKS"], "failed_once")
    if e["RANK"] == "1" and not os.path.exists(mark):
        open(mark, "w").close()
        os._exit(3)
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    forked = 'module_table' in repr(sys.meta_path)
    os.write(1, (f"RUN rank={e['RANK']} group={e['GROUP_RANK']} world={e['WORLD_SIZE']} "
                 f"restart={e['TORCHELASTIC_RESTART_COUNT']} "
                 f"max={e['TORCHELASTIC_MAX_RESTARTS']} sum={t.item()} forked={forked}\\n").encode())
    dist.destroy_process_group()
    """)


def test_restarts_fork_the_ranks_again_with_torchruns_count(torch_launcher, tmp_path):
    """--max-restarts=1: node 1 restarts its failed rank (TORCHELASTIC_RESTART_COUNT=1), node 0
    its waiting one for the new membership (its count stays 0), all forked again."""
    def outcome(results, way):
        runs = [sorted(line for line in output.splitlines() if line.startswith("RUN "))
                for _, output, _ in results]
        assert all(line.endswith(f"forked={way == 'launcher'}") for run in runs for line in run)
        return [code for code, _, _ in results], [[l.rsplit(" ", 1)[0] for l in run] for run in runs]

    def node_args(port):
        return lambda k: [*static(port)(k)[:1], "--nproc-per-node=1", *static(port)(k)[2:],
                          "--max-restarts=1", "--monitor-interval=0.5"]
    seen = {}
    for way in ("plain", "launcher"):
        marks = tmp_path / way
        marks.mkdir()
        results = run_nodes(torch_launcher, tmp_path, [way] * 2, node_args(_free_port()),
                            MARKS=str(marks), program=FLAKY)
        assert [via for _, _, via in results] == [way.replace("launcher", "zygote")] * 2
        seen[way] = outcome(results, way)
    assert seen["plain"][0] == [0, 0] and "restart=1" in seen["plain"][1][1][0], seen
    assert seen["launcher"] == seen["plain"]
