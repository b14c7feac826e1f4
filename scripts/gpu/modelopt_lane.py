"""Model-Optimizer's example tests in several ways in one call, each way a fresh pytest session,
the launcher's from an empty cache:

* ``subprocess``: as the suite runs them (each step a plain subprocess);
* ``launcher``: ``_run_capturing`` swapped for the launcher (scripts/gpu/modelopt_lane_swap.py);
* ``suite``: nothing swapped, ``PRELOAD_LAUNCHER=suite`` (every interpreter the tests start);
* ``forked``: as ``suite``, with pytest itself forked from a daemon: ``preload-launcher serve
  --detach --pytest`` then ``preload-launcher run -- python -m pytest …`` (the wall counts both).

    python3 scripts/gpu/modelopt_lane.py --checkout .modelopt --lanes spec,spec_ptq,onnx --out DIR

Writes to DIR: report.txt (per-test call time and outcome both ways, the whole pytest wall both
ways, parity, the launcher plugin's summary, per-test step time), <way>.log (pytest's output),
<way>.xml (junit, call durations), and steps.jsonl (every example step: test, command, via,
reason, seconds). scripts/gpu/modelopt_lane.sh sets up the
wheels and PYTHONPATH on the GPU machine and calls this.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

import lane_processes  # noqa: E402  (beside this script)
from modelopt_lane_tests import DROPPED, LANES, POISON  # noqa: E402

DEFAULT_MODULES = "torch,transformers,accelerate,datasets,modelopt.torch"
WAYS = ("subprocess", "launcher", "suite", "forked")


def plugin_installed() -> bool:
    """The launcher's plugin registered by entry point (an installed package)."""
    return any(ep.name == "preload_launcher"
               for ep in importlib.metadata.entry_points(group="pytest11"))


def pytest_command(way: str, tests: list[str], out: str, basetemp: str,
                   test_timeout_s: float = 0) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", "-o", "addopts=", "-o", "junit_duration_report=call",
           "-o", "junit_logging=system-out", "-o", "junit_log_passing_tests=false",
           "-v", "-rA", "--durations=0", "--strict-markers", "-p", "no:cacheprovider",
           "-p", "modelopt_lane_swap", f"--junitxml={os.path.join(out, way + '.xml')}",
           f"--basetemp={basetemp}"]
    if test_timeout_s:  # pytest-timeout's thread method: every thread's stack of a hung test
        # (its signal method waits for the main thread to come back from C, which a deadlock
        # never does), then the session ends
        cmd += [f"--timeout={test_timeout_s:g}", "--timeout-method=thread"]
    if way != "subprocess":
        if not plugin_installed():  # -p: the plugin by name where the package is on PYTHONPATH
            cmd += ["-p", "preload_launcher.pytest_plugin"]
    else:
        cmd += ["-p", "no:preload_launcher"]
    return cmd + tests


def session_env(way: str, args, cache: str, steps: str) -> dict:
    env = dict(os.environ)
    path = [os.path.abspath(args.checkout)] + [p for p in env.get("PYTHONPATH", "").split(":") if p]
    env.update(PYTHONPATH=":".join(path + [ROOT, HERE]), MODELOPT_LANE_WAY=way,
               MODELOPT_LANE_STEPS=steps, PRELOAD_LAUNCHER_CACHE_DIR=cache,
               PRELOAD_LAUNCHER_MODULES=args.modules, PYTHONUNBUFFERED="1",
               # The GPU machine has no network: the same everywhere, so nothing waits on DNS.
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env[lane_processes.MARK] = f"{way}-{os.getpid()}-{time.time_ns()}"  # its processes' mark
    if args.test_timeout_s:  # the suite's conftest marks every example test with this cap, and
        # pytest-timeout lets a test's marker win over --timeout
        env["MODELOPT_QA_TEST_TIMEOUT"] = f"{args.test_timeout_s:.0f}"
    env.pop("PRELOAD_LAUNCHER", None)
    # torch's JIT extension cache (modelopt builds modelopt_cuda_ext* there on first use): the
    # same start for every way, either one pre-built folder or an empty one each.
    if args.torch_extensions == "fresh":
        env["TORCH_EXTENSIONS_DIR"] = tempfile.mkdtemp(prefix=f"lane-ext-{way}-")
    elif args.torch_extensions:
        env["TORCH_EXTENSIONS_DIR"] = args.torch_extensions
    # torch.compile's caches (inductor's, triton's kernels): a way that runs after another
    # would find them filled (spec_compile's first run: the second way compiled warm).
    for variable in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        env[variable] = tempfile.mkdtemp(prefix=f"lane-{variable.split('_')[0].lower()}-{way}-")
    if way == "subprocess":
        env["PRELOAD_LAUNCHER"] = "0"
    elif way in ("suite", "forked"):
        env["PRELOAD_LAUNCHER"] = "suite"
    return env


CLI = [sys.executable, "-m", "preload_launcher.cli"]


def run_session(way: str, args, tests: list[str]) -> tuple[float, int, str]:
    cache = tempfile.mkdtemp(prefix=f"lane-cache-{way}-")  # empty launcher cache
    basetemp = tempfile.mkdtemp(prefix=f"lane-tmp-{way}-")
    log = os.path.join(args.out, way + ".log")
    env = session_env(way, args, cache, os.path.join(args.out, "steps.jsonl"))
    cmd = pytest_command(way, tests, args.out, basetemp, args.test_timeout_s)
    # The launcher's runtime folder (zygote logs) where the lane can read it if the session hangs
    env["XDG_RUNTIME_DIR"] = runtime = tempfile.mkdtemp(prefix=f"lane-run-{way}-")
    print(f"== {way}: {' '.join(cmd[1:])}\n   cache {cache} (empty: {not os.listdir(cache)})",
          flush=True)
    start = time.perf_counter()
    if way == "forked":  # a daemon of the suite's preload set, as pytest runs (modelopt's
        # triton kernels read PYTEST_VERSION at import), then pytest forked from it
        subprocess.run(CLI + ["serve", "--detach", "--pytest"], cwd=args.checkout, env=env,
                       check=True)
        cmd = CLI + ["run", "-v", "--"] + cmd
    # A zygote removes its log when its session ends: copied every 10 s while the session runs.
    copying = threading.Event()
    threading.Thread(target=keep_logs, daemon=True, args=(
        runtime, os.path.join(args.out, way + "-launcher-logs"), copying)).start()
    before = set(lane_processes.processes())
    ended = os.path.join(args.out, way + "-ended.txt")  # what the lane ended, for the report
    if os.path.exists(ended):
        os.remove(ended)
    sampler = None
    if args.sample:  # PATTERN:DELAY:SECONDS
        pattern, delay, seconds = args.sample.rsplit(":", 2)
        sampler = lane_processes.Sampler(env[lane_processes.MARK], before, pattern, float(delay),
                                         float(seconds), os.path.join(args.out, way + "-profile.txt"))
        sampler.start()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=args.checkout, env=env, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=args.session_limit_s)
        except subprocess.TimeoutExpired:
            rc = stop_at_limit(way, args, proc, before, ended, env[lane_processes.MARK])
    wall = time.perf_counter() - start
    if sampler is not None:
        sampler.stopped.set()
        sampler.join(timeout=float(args.sample.rsplit(":", 1)[1]) + 30)
        if sampler.note:
            note(os.path.join(args.out, way + "-profile-note.txt"), sampler.note, [])
    if way == "forked":
        subprocess.run(CLI + ["stop"], cwd=args.checkout, env=env)
    left = lane_processes.end(lane_processes.made_by(env[lane_processes.MARK], before))
    if left:  # the next way starts on an idle machine
        note(ended, f"left running after the session, ended: {len(left)}", left)
    shutil.rmtree(basetemp, ignore_errors=True)
    made = ["TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"]  # this way's own, made empty for it
    made += ["TORCH_EXTENSIONS_DIR"] if args.torch_extensions == "fresh" else []
    for variable in made:
        shutil.rmtree(env[variable], ignore_errors=True)
    copying.set()
    shutil.rmtree(cache, ignore_errors=True)
    shutil.rmtree(runtime, ignore_errors=True)
    return wall, rc, log


def stop_at_limit(way: str, args, proc: subprocess.Popen, before: set, ended: str,
                  session: str) -> int:
    """What every process was doing at the limit; then the session's orphans (parent init, not
    the launcher's daemon) are ended, which lets pytest finish a test that waited on an output
    pipe an orphan held, and report it; pytest's group is stopped if it still runs 90 s on."""
    lane_processes.snapshot(os.path.join(args.out, way + "-processes-at-limit.txt"))
    lane_processes.dump_stacks(lane_processes.made_by(session, before),
                               os.path.join(args.out, way + "-stacks-at-limit.txt"))
    orphans = [p for p in lane_processes.orphans_of(session, before)
               if "preload_launcher" not in p.command]
    lines = lane_processes.end(orphans)
    if lines:
        note(ended, f"at the session limit ({args.session_limit_s:.0f} s), orphans the session "
                    f"made, ended: {len(lines)}", lines)
        try:
            rc = proc.wait(timeout=90)
            note(ended, f"pytest then ended by itself (exit {rc}): this way's outcomes are "
                        f"the ones it reported after that", [])
            print(f"   {way}: at {args.session_limit_s} s the lane ended {len(lines)} orphans; "
                  f"pytest ended by itself", flush=True)
            return rc
        except subprocess.TimeoutExpired:
            pass
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        rc = proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        rc = proc.wait()
    print(f"   {way}: stopped after {args.session_limit_s} s (--session-limit-s)", flush=True)
    return rc


def note(path: str, title: str, lines: list[str]) -> None:
    with open(path, "a") as f:
        f.write("\n".join([title] + ["  " + line for line in lines]) + "\n")


def keep_logs(runtime: str, dest: str, done: threading.Event) -> None:
    """The launcher's logs (a zygote's z-*.log), copied every 10 s until ``done``."""
    while not done.wait(10):
        for folder, _, files in os.walk(runtime):
            for name in files:
                if name.endswith(".log"):
                    os.makedirs(dest, exist_ok=True)
                    try:
                        shutil.copy(os.path.join(folder, name), dest)
                    except OSError:
                        pass  # removed meanwhile


def junit_results(path: str) -> dict[str, tuple[str, float, str]]:
    """test name -> (outcome, call seconds, the root cause of a failure)."""
    if not os.path.exists(path):
        return {}
    results = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        outcome, cause = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed"}.get(child.tag, child.tag)
                cause = root_cause(case, child)
                break
        results[name] = (outcome, float(case.get("time") or 0.0), cause)
    return results


def root_cause(case, child) -> str:
    """The step's own last exception line (from the test's captured output), else the message."""
    texts = [c.text or "" for c in case if c.tag == "system-out"] + [child.text or ""]
    for text in texts:
        lines = [ln.strip() for ln in text.splitlines()
                 if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt)\b.*", ln.strip())
                 and "CalledProcessError" not in ln]
        if lines:
            return lines[-1][:160]
    return (child.get("message") or "").splitlines()[0][:160] if child.get("message") else ""


def short_name(nodeid: str) -> str:
    """tests/x/test_a.py::test_b[p] -> test_a::test_b[p], as junit_results names a test."""
    path, _, name = nodeid.partition("::")
    return f"{os.path.splitext(os.path.basename(path))[0]}::{name}"


def step_seconds(path: str) -> dict[tuple[str, str], list[dict]]:
    rows: dict[tuple[str, str], list[dict]] = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                row = json.loads(line)
                rows.setdefault((row["way"], short_name(row["test"])), []).append(row)
    return rows


def plugin_summary(log: str) -> list[str]:
    """The launcher plugin's terminal summary section from pytest's output."""
    lines, keep = [], False
    with open(log, errors="replace") as f:
        for line in f:
            if line.startswith("=") or line.startswith("-"):
                keep = "preload_launcher" in line
                continue
            if keep:
                lines.append(line.rstrip())
    return lines


def report(args, tests, walls: dict, logs: dict) -> str:
    """Per test: outcome and call time each way (and subprocess / way); per way: the whole
    pytest wall, its share of the subprocess wall, parity; the steps; the plugin's summaries."""
    ways = [w for w in WAYS if w in walls]
    res = {way: junit_results(os.path.join(args.out, way + ".xml")) for way in ways}
    steps = step_seconds(os.path.join(args.out, "steps.jsonl"))
    names = list(dict.fromkeys(n for way in ways for n in res[way]))
    if args.merge:  # the calls' own headers: where and when each way ran
        return merged_header(args) + report_body(args, ways, res, steps, names, walls, logs)
    out = [f"# Model-Optimizer example tests, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} "
           f"on {os.uname().nodename}; Python {sys.version.split()[0]}; {gpu_line()}",
           f"# checkout {args.checkout} at {checkout_commit(args.checkout)}; lanes {args.lanes}; "
           f"preload {args.modules}; each way a fresh pytest session, launcher from an empty cache; "
           f"order {args.ways}; TORCH_EXTENSIONS_DIR {ext_line(args)}; inductor's and "
           f"triton's caches an empty one per way"]
    return "\n".join(out) + "\n" + report_body(args, ways, res, steps, names, walls, logs)


def merged_header(args) -> str:
    lines = ["# merged from " + ", ".join(args.merge.split(","))]
    for folder in args.merge.split(","):
        with open(os.path.join(folder, "report.txt")) as f:
            lines += [f"# {folder}:"] + [f.readline().rstrip(), f.readline().rstrip()]
    return "\n".join(lines) + "\n"


def report_body(args, ways, res, steps, names, walls, logs) -> str:
    out = ["", f"{'test':58} " + " ".join(f"{w:>16}" for w in ways) + "  steps (s) per way"]
    for name in names:
        row = [f"{name[:58]:58}"]
        for way in ways:
            outcome, secs, _ = res[way].get(name, ("-", 0.0, ""))
            row.append(f"{outcome[:6]:>7} {secs:7.1f}s")
        per_way = "/".join(f"{sum(r['seconds'] for r in steps.get((w, name), [])):.1f}"
                           for w in ways)
        out.append(" ".join(row) + f"  {per_way}{ratios(res, ways, name)}")
    base = walls.get("subprocess")
    for way in ways:
        counts = {}
        for outcome, _, _ in res[way].values():
            counts[outcome] = counts.get(outcome, 0) + 1
        share = (f"; {walls[way][0] / base[0]:.0%} of subprocess, {base[0] / walls[way][0]:.2f}x"
                 if base and way != "subprocess" else "")
        out.append(f"whole pytest wall, {way:10}: {walls[way][0]:7.1f} s (exit {walls[way][1]}; "
                   f"{', '.join(f'{v} {k}' for k, v in sorted(counts.items()))}){share}")
    if "subprocess" in res:
        for way in [w for w in ways if w != "subprocess"]:
            broken = [n for n in names if res["subprocess"].get(n, ("",))[0] == "passed"
                      and res[way].get(n, ("",))[0] != "passed"]
            out.append(f"parity, {way}: every test that passed as subprocesses passed"
                       if not broken else f"PARITY BROKEN, {way}: {broken}")
    for n in names:
        for way in ways:
            outcome, _, msg = res[way].get(n, ("", 0, ""))
            if outcome in ("failed", "error", "skipped"):
                out.append(f"  {way} {outcome} {n}: {msg}")
    out += ["", "steps (test, command, via, reason, seconds):"]
    for (way, test), rows in steps.items():
        for r in rows:
            cmd = " ".join(r["cmd"].split())  # one line, whatever a `python -c` held
            out.append(f"  {way:10} {test[:55]:55} {cmd[:40]:40} {r['via']:10} "
                       f"{r['seconds']:6.1f}s rc={r['returncode']} {r['reason']}")
    for way in ways:
        profile, about = (os.path.join(args.out, way + name) for name in
                          ("-profile.txt", "-profile-note.txt"))
        if os.path.exists(about):
            with open(about) as f:
                out += ["", f"sampled step, {way}: {f.read().strip()}"]
        if os.path.exists(profile):
            out += ["  " + line for line in lane_processes.top_frames(profile)]
    for way in ways:
        ended = os.path.join(args.out, way + "-ended.txt")
        if os.path.exists(ended):
            with open(ended) as f:
                out += ["", f"processes the lane ended, {way}:"] + \
                       ["  " + line for line in f.read().splitlines()]
    for way in ways:
        if way != "subprocess":
            out += ["", f"launcher plugin summary, {way}:"] + \
                   ["  " + line for line in plugin_summary(logs[way])]
    out += ["", "dropped:"] + [f"  {what}: {why}" for what, why in DROPPED]
    return "\n".join(out) + "\n"


def ratios(res: dict, ways: list[str], name: str) -> str:
    """subprocess call time / each other way's, for one test."""
    base = res.get("subprocess", {}).get(name, ("", 0.0, ""))[1]
    shown = [f"{w} {base / res[w][name][1]:.1f}x" for w in ways
             if w != "subprocess" and base and res[w].get(name, ("", 0.0))[1] > 0]
    return f"  ({', '.join(shown)})" if shown else ""


def ext_line(args) -> str:
    if args.torch_extensions == "fresh":
        return "an empty one per way"
    if args.torch_extensions:
        built = sorted(os.listdir(args.torch_extensions)) if os.path.isdir(args.torch_extensions) else []
        return f"{args.torch_extensions}, shared, holding {', '.join(built) or 'nothing'} at the start"
    return "torch's default"  # (--torch-extensions '': every way shares torch's own folder)


def gpu_line() -> str:
    try:
        names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=30).stdout.split("\n")
        names = [n for n in names if n.strip()]
    except (OSError, subprocess.TimeoutExpired):
        names = []
    return f"{len(names)} x {names[0]}" if names else f"no GPU, {os.cpu_count()} CPUs"


def checkout_commit(checkout: str) -> str:
    path = os.path.join(checkout, "COMMIT")
    return open(path).read().strip() if os.path.exists(path) else "unknown commit"


def merge(args) -> tuple[dict, dict]:
    """The ways of several earlier calls' output folders, copied into --out for one report."""
    walls, logs = {}, {}
    with open(os.path.join(args.out, "steps.jsonl"), "w") as steps:
        for folder in args.merge.split(","):
            with open(os.path.join(folder, "walls.json")) as f:
                for way, wall in json.load(f).items():
                    walls[way] = tuple(wall)
                    for ext in (".xml", ".log"):
                        if os.path.abspath(folder) != os.path.abspath(args.out):
                            shutil.copy(os.path.join(folder, way + ext), args.out)
                    logs[way] = os.path.join(args.out, way + ".log")
            with open(os.path.join(folder, "steps.jsonl")) as f:
                steps.write(f.read())
    return walls, logs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkout", default=os.path.join(ROOT, ".modelopt"))
    parser.add_argument("--lanes", default="spec,spec_ptq,onnx",
                        help=f"comma-separated, of {', '.join(LANES)}")
    parser.add_argument("--tests", default="", help="comma-separated node ids instead of --lanes")
    parser.add_argument("--ways", default="launcher,subprocess",
                        help=f"the sessions, in order (the first pays cold disk caches), of "
                             f"{', '.join(WAYS)}")
    parser.add_argument("--modules", default=DEFAULT_MODULES, help="the launcher's preload set")
    parser.add_argument("--session-limit-s", type=float, default=540,
                        help="stop a pytest session after this many seconds")
    parser.add_argument("--test-timeout-s", type=float, default=0,
                        help="pytest-timeout's --timeout for every test, thread method, and the "
                             "suite's own cap of its example tests (0: none)")
    parser.add_argument("--sample", default="",
                        help="SCRIPT:DELAY:SECONDS: py-spy samples the first process of each "
                             "session that runs SCRIPT (not one passing it on), from DELAY s after it "
                             "appears, for SECONDS s (<way>-profile.txt; the report's top frames)")
    # The default gives every way the same start: torch's own folder, shared, made the later way
    # find what the earlier one built (2026-12-05: the pools' suite session paid 227 s of builds
    # in its first fixture, the subprocess session after it none).
    parser.add_argument("--torch-extensions", default="fresh",
                        help="TORCH_EXTENSIONS_DIR for every way: a pre-built folder, or 'fresh' "
                             "(an empty one per way, the default)")
    parser.add_argument("--poison", action="store_true",
                        help=f"copy scripts/gpu/pool_poison.py to {POISON} in the checkout")
    parser.add_argument("--merge", default="",
                        help="comma-separated output folders of earlier calls: one report of "
                             "their ways (each folder's <way>.xml/.log, walls.json, steps.jsonl)")
    parser.add_argument("--out", default=os.environ.get("OUT") or "lane-out")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    args.checkout = os.path.abspath(args.checkout)
    tests = ([t for t in args.tests.split(",") if t] or
             [t for lane in args.lanes.split(",") for t in LANES[lane]])
    if args.merge:
        walls, logs = merge(args)
    else:
        if args.poison:
            shutil.copy(os.path.join(HERE, "pool_poison.py"), os.path.join(args.checkout, POISON))
        open(os.path.join(args.out, "steps.jsonl"), "w").close()
        walls, logs = {}, {}
        for way in args.ways.split(","):
            wall, rc, log = run_session(way, args, tests)
            walls[way], logs[way] = (wall, rc), log
            print(f"   {way}: {wall:.1f} s, exit {rc}", flush=True)
            with open(os.path.join(args.out, "walls.json"), "w") as f:
                json.dump(walls, f)
    text = report(args, tests, walls, logs)
    with open(os.path.join(args.out, "report.txt"), "w") as f:
        f.write(text)
    print(text, flush=True)


if __name__ == "__main__":
    main()
