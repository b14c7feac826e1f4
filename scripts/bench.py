"""Times the same steps four ways in one run: plain subprocess/torchrun, the launcher, the
launcher with pre-warmed children, and an in-process baseline (each step re-run with runpy in
one long-lived process per rank, as an in-process test runner does).

    python scripts/bench.py                 # CPU or GPU picked automatically
    python scripts/bench.py --steps 9 --json out.json --scaling
    python scripts/bench.py --sections suite --suite-reps 2 --subprocess-reps 1

Sections: ``rows`` (import-heavy single steps), ``suite`` (six megatron-core GPT steps shaped
like example tests -- build, train, save and load a distributed checkpoint, modelopt quantize,
generate -- at 1 rank and at N ranks: all GPUs, or 2 gloo ranks on CPU), ``scaling`` (an
all-reduce step at 1, 2, 4, 8 ranks on CPU or 1..N GPUs). Prints per-step medians, totals,
ratios, the zygote's preload time (paid once), its RSS and a running step's PSS, the launcher's
own overhead (request -> first line of user code) and where each suite step's time goes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from preload_launcher import Launcher  # noqa: E402

STEPS = os.path.join(HERE, "steps")
PY = sys.executable
TORCHRUN = os.path.join(os.path.dirname(PY), "torchrun")
STACK = ["torch", "megatron.core", "modelopt.torch"]


def gpu_count() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
        return len([l for l in out.stdout.splitlines() if l.startswith("GPU ")])
    except (OSError, subprocess.SubprocessError):
        return 0


def workloads(gpus: int) -> list[tuple[str, list[str]]]:
    step = lambda name: os.path.join(STEPS, name)  # noqa: E731
    tests = os.path.join(os.path.dirname(HERE), "tests", "programs")
    work = [("empty step (python -c pass)", [PY, "-c", "pass"]),
            ("import torch + matmul (1 rank)", [PY, step("torch_step.py")]),
            ("import torch+megatron.core+modelopt.torch (1 rank)", [PY, step("stack_step.py")])]
    if gpus:
        work.append(("megatron-core GPT fwd+bwd (1 GPU)",
                     [TORCHRUN, "--nproc_per_node=1", step("gpt_step.py")]))
        if gpus > 1:
            work.append((f"megatron-core GPT TP={gpus} (NCCL)",
                         [TORCHRUN, f"--nproc_per_node={gpus}", step("gpt_step.py")]))
    else:
        work.append(("megatron parallel state, 2 gloo ranks",
                     [TORCHRUN, "--nproc_per_node=2",
                      os.path.join(tests, "megatron_parallel_state.py")]))
    return work


SUITE_PHASES = ("build", "train", "save", "load", "quantize", "generate")
SEGMENTS = (("launch", "t0", "start"), ("imports", "start", "imports"),
            ("dist init", "imports", "dist_init"), ("model", "dist_init", "model"),
            ("work", "model", "work"), ("teardown", "work", "end"), ("return", "end", "atexit"),
            ("exit", "atexit", "t1"))
INPROCESS_STALL_S = 90.0  # an in-process worker with no finished run for this long has hung


def suite_cmd(ranks: int, phase: str, ckpt_dir: str) -> list[str]:
    return [TORCHRUN, f"--nproc_per_node={ranks}", os.path.join(STEPS, "gpt_suite.py"), phase,
            "--dir", ckpt_dir]


def stamps_of(output: str) -> dict:
    """The suite step's stage stamps, and when its first atexit handler ran (rank 0)."""
    lines = output.splitlines()
    line = next((l for l in lines if l.startswith("PHASES ")), None)
    stamps = json.loads(line.split(" ", 1)[1]) if line else {}
    atexit_line = next((l for l in lines if l.startswith("ATEXIT ")), None)
    if atexit_line:
        stamps["atexit"] = float(atexit_line.split()[1])
    return stamps


def timed(run, args: list[str]) -> dict:
    """One run: seconds, the step's stage stamps, and its output tail when it failed."""
    t0 = time.time()
    returncode, output = run(args)
    t1 = time.time()
    stamps = {**stamps_of(output), "t0": t0, "t1": t1}
    row = {"s": t1 - t0, "ok": returncode == 0,
           "segments": {name: stamps[b] - stamps[a] for name, a, b in SEGMENTS
                        if a in stamps and b in stamps}}
    if returncode:
        row["failure"] = output[-3000:]
        print(f"  FAILED ({returncode}): {' '.join(args[-4:])}\n{output[-1500:]}", flush=True)
    return row


def run_subprocess(args: list[str]) -> tuple[int, str]:
    out = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return out.returncode, out.stdout


def run_launcher(launcher: Launcher):
    def run(args: list[str]) -> tuple[int, str]:
        result = launcher.run(args, timeout=600)
        if result.via != "zygote":
            return 255, f"not served by the zygote: {result.reason}\n{result.stdout}"
        return result.returncode, result.stdout
    return run


def inprocess_runs(cmd: list[str]) -> tuple[dict, str]:
    """Per-step run times of an in-process worker, and why it stopped early ('' if it did not).
    A worker that finishes no run for INPROCESS_STALL_S is killed as hung."""
    import selectors
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    times: dict = {}
    lines: list[str] = []
    why = ""
    last_progress = time.monotonic()
    while True:
        if not selector.select(timeout=5):
            if time.monotonic() - last_progress > INPROCESS_STALL_S:
                os.killpg(proc.pid, 9)
                why = f"hung (no run finished for {INPROCESS_STALL_S:.0f} s; killed)"
                break
            continue
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith("INPROCESS "):
            run = json.loads(line.split(" ", 1)[1])
            times.setdefault(run["step"], []).append(run["s"])
            last_progress = time.monotonic()
    code = proc.wait()
    if code and not why:
        errors = [l.strip() for l in lines if "Error" in l]
        why = (errors[-1] if errors else f"exit code {code}")[:300]
    return times, why


def suite_inprocess(ranks: int, reps: int, ckpt_dir: str) -> dict:
    """All six steps re-run in one process per rank; the first, importing round is dropped."""
    worker = os.path.join(HERE, "inprocess_worker.py")
    script = os.path.join(STEPS, "gpt_suite.py")
    commands = []
    for phase in SUITE_PHASES:
        commands += ["--", script, phase, "--dir", ckpt_dir]
    times, why = inprocess_runs([TORCHRUN, f"--nproc_per_node={ranks}", worker, str(reps + 1),
                                 *commands[1:]])
    result = {}
    for phase in SUITE_PHASES:
        runs = times.get(f"{script} {phase} --dir {ckpt_dir}", [])[1:]
        result[phase] = runs if len(runs) == reps else None  # None: it failed on a re-run
    if why:
        failed = next((p for p in SUITE_PHASES if result[p] is None), "?")
        print(f"  in-process: stopped at {failed}: {why}", flush=True)
    result["stopped"] = why
    return result


def median_or_none(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


WAYS = ("subprocess", "launcher", "prewarm", "prewarm-kernels", "inprocess")


def suite(ranks: int, stack: list[str], launcher: Launcher, reps: int, subprocess_reps: int,
          chosen: list[str]) -> dict:
    """The six-step suite, each chosen way, at ``ranks`` ranks; medians per step and totals."""
    import tempfile
    warm = {way: prewarmed_launcher(stack, ranks, "kernels" if way.endswith("kernels") else "context")
            for way in chosen if way.startswith("prewarm")}
    ways = {way: (run_subprocess, subprocess_reps) if way == "subprocess" else
            (run_launcher(warm.get(way, launcher)), reps) for way in chosen if way != "inprocess"}
    runs = {way: {p: [] for p in SUITE_PHASES} for way in ways}
    for way, (run, n) in ways.items():
        ckpt = tempfile.mkdtemp(prefix=f"suite-{way}-")
        for _ in range(n):
            for phase in SUITE_PHASES:
                runs[way][phase].append(timed(run, suite_cmd(ranks, phase, ckpt)))
    for launcher_of_way in warm.values():
        launcher_of_way.close()
    inproc = suite_inprocess(ranks, reps, tempfile.mkdtemp(prefix="suite-inproc-")) \
        if "inprocess" in chosen \
        else {p: None for p in SUITE_PHASES} | {"stopped": "not run"}
    table = {}
    for phase in SUITE_PHASES:
        row = {way: median_or_none([r["s"] if r["ok"] else None for r in runs[way][phase]])
               for way in ways}
        row["subprocess"] = row.get("subprocess")
        row["inprocess"] = median_or_none(inproc[phase] or [])
        row["segments"] = {way: {name: median_or_none([r["segments"].get(name) for r in runs[way][phase]])
                                 for name, _, _ in SEGMENTS} for way in ways}
        table[phase] = row
    totals = {way: sum(table[p][way] for p in SUITE_PHASES)
              if all(table[p].get(way) is not None for p in SUITE_PHASES) else None
              for way in (*ways, "inprocess")}
    print_suite(ranks, table, totals, list(ways))
    return {"ranks": ranks, "steps": table, "totals": totals, "inprocess_stopped": inproc["stopped"],
            "runs": {way: {p: [r["s"] for r in rs] for p, rs in per.items()} for way, per in runs.items()}}


def _fmt(seconds) -> str:
    return "   fails" if seconds is None else f"{seconds:7.2f}s"


def print_suite(ranks: int, table: dict, totals: dict, ways: list[str]) -> None:
    print(f"\nsix-step megatron-core suite, {ranks} rank(s), medians")
    forked = [w for w in ways if w != "subprocess"]
    print(f"{'step':10} " + " ".join(f"{w:>15}" for w in [*ways, "inprocess"]) + " " +
          " ".join(f"{'sub/' + w:>20}" for w in forked))
    for phase, row in [*table.items(), ("TOTAL", totals)]:
        ratios = [f"{row['subprocess'] / row[w]:19.1f}x" if row.get("subprocess") and row.get(w)
                  else f"{'-':>20}" for w in forked]
        print(f"{phase:10} " + " ".join(f"{_fmt(row.get(w)):>15}" for w in [*ways, "inprocess"]) +
              " " + " ".join(ratios), flush=True)
    print(f"where the time goes (medians, s): {', '.join(n for n, _, _ in SEGMENTS)}")
    for phase, row in table.items():
        for way in ways:
            seg = row["segments"][way]
            print(f"  {phase:9} {way:10} " + " ".join(
                "   -  " if seg[n] is None else f"{seg[n]:6.3f}" for n, _, _ in SEGMENTS))


def time_subprocess(args: list[str]) -> float:
    start = time.perf_counter()
    out = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    elapsed = time.perf_counter() - start
    if out.returncode:
        raise SystemExit(f"subprocess step failed: {args}\n{out.stdout[-3000:]}")
    return elapsed


def time_launcher(launcher: Launcher, args: list[str]) -> tuple[float, float]:
    start = time.perf_counter()
    result = launcher.run(args)
    elapsed = time.perf_counter() - start
    if result.returncode or result.via != "zygote":
        raise SystemExit(f"launcher step failed ({result.via} {result.reason}): {args}\n"
                         f"{result.stdout[-3000:]}")
    return elapsed, result.exec_delay_s or 0.0


def time_inprocess(cmd: list[str], reps: int) -> list[float]:
    """Run the step reps times inside one process (per rank); the first run pays the imports."""
    worker = os.path.join(HERE, "inprocess_worker.py")
    script = cmd[-1]
    prefix = cmd[:-1] if cmd[0] == TORCHRUN else [PY]
    times, why = inprocess_runs(prefix + [worker, str(reps + 1), script])
    runs = times.get(script, [])[1:]  # steady state: without the importing run
    return runs if not why else []


def step_pss_mib(launcher: Launcher, cmd: list[str]) -> float:
    """PSS of a running step (and its ranks), sampled from the zygote's status mid-step."""
    import threading
    probe = [PY, "-c", "import time, torch; time.sleep(1.5)"]
    t = threading.Thread(target=launcher.run, args=(probe,))
    t.start()
    time.sleep(0.8)
    pss = launcher.zygotes[0].request("status")["steps_pss_kb"] / 1024
    t.join()
    return pss


def scaling(launcher: Launcher, gpus: int, reps: int) -> list[dict]:
    ranks = [n for n in (1, 2, 4, 8) if not gpus or n <= gpus]
    rows = []
    print(f"\n{'all-reduce step, ranks':28} {'torchrun':>9} {'launcher':>9} {'ratio':>7} {'overhead':>9}")
    for n in ranks:
        cmd = [TORCHRUN, f"--nproc_per_node={n}", os.path.join(STEPS, "allreduce_step.py")]
        sub = [time_subprocess(cmd) for _ in range(reps)]
        ours = [time_launcher(launcher, cmd) for _ in range(reps)]
        row = {"ranks": n, "torchrun_s": statistics.median(sub),
               "launcher_s": statistics.median(t for t, _ in ours),
               "overhead_ms": 1000 * statistics.median(d for _, d in ours)}
        rows.append(row)
        print(f"{n:28d} {row['torchrun_s']:8.2f}s {row['launcher_s']:8.3f}s "
              f"{row['torchrun_s'] / row['launcher_s']:6.1f}x {row['overhead_ms']:7.1f}ms", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="runs of each row step each way")
    parser.add_argument("--sections", default="rows,suite", help="rows, suite, scaling")
    parser.add_argument("--suite-reps", type=int, default=3, help="suite runs through the launcher")
    parser.add_argument("--subprocess-reps", type=int, default=3, help="suite runs as subprocesses")
    parser.add_argument("--ways", default="subprocess,launcher,prewarm,inprocess",
                        help=f"suite ways, of {','.join(WAYS)}")
    parser.add_argument("--suite-ranks", default="",
                        help="rank counts for the suite (default: 1 and all GPUs, or 1,2 on CPU)")
    parser.add_argument("--prime", action="store_true",
                        help="run the suite's quantize step once, untimed, first (modelopt builds "
                             "its CUDA extension on first use, once per machine)")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--scaling", action="store_true", help="same as adding 'scaling'")
    parser.add_argument("--only", default="", help="run only rows whose name contains this")
    parser.add_argument("--preload", default=",".join(STACK), help="the zygote's preload list")
    args = parser.parse_args()
    sections = set(args.sections.split(",")) | ({"scaling"} if args.scaling else set())
    gpus = gpu_count()
    machine = f"{platform.node()}: {os.cpu_count()} CPUs, {gpus} GPUs, Python {platform.python_version()}"
    print(f"# preload_launcher benchmark on {machine}; {time.strftime('%Y-%m-%d %H:%M')}")

    stack = args.preload.split(",")
    launcher = Launcher(stack)
    start = time.perf_counter()
    zygote = launcher.zygote_for(dict(os.environ))
    preload_s = time.perf_counter() - start
    report = zygote.status["preload"]
    print(f"# zygote preload of {','.join(report['loaded'])}: {preload_s:.1f} s (paid once), "
          f"RSS {zygote.status['rss_kb'] / 1024:.0f} MiB; quarantined: "
          f"{sorted(report.get('quarantined', {})) or 'none'}; a running torch step's PSS: "
          f"{step_pss_mib(launcher, []):.0f} MiB\n", flush=True)
    results = {"machine": machine, "date": time.strftime("%Y-%m-%d"), "preload_s": preload_s,
               "preload": report.get("loaded"), "rows": [], "suite": [], "scaling": []}

    def save() -> None:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)

    if "rows" in sections:
        results["rows"] = rows(launcher, stack, gpus, args)
        save()
    if "suite" in sections:
        if args.prime:
            import tempfile
            primed = timed(run_launcher(launcher), suite_cmd(1, "quantize", tempfile.mkdtemp()))
            print(f"# priming: the first quantize step on this machine took {primed['s']:.1f} s "
                  f"(its 'work' {primed['segments'].get('work', 0):.1f} s)\n", flush=True)
            results["priming_s"] = primed["s"]
        default_ranks = sorted({1, gpus if gpus > 1 else (0 if gpus else 2)} - {0})
        for ranks in ([int(r) for r in args.suite_ranks.split(",")] if args.suite_ranks
                      else default_ranks):
            results["suite"].append(suite(ranks, stack, launcher, args.suite_reps,
                                          args.subprocess_reps, args.ways.split(",")))
            save()
    if "scaling" in sections:
        results["scaling"] = scaling(launcher, gpus, max(2, args.steps // 2))
        save()
    results["zygotes_started"] = launcher.stats["zygotes_started"]
    print(f"# zygotes started by this run's launcher: {results['zygotes_started']}")
    save()
    launcher.close()


def prewarmed_launcher(stack: list[str], ranks: int, cuda: str = "context") -> Launcher:
    """A launcher whose zygote keeps a warm child and a warm ``ranks``-rank torchrun agent."""
    settings = {"PRELOAD_LAUNCHER_PREWARM": "1", "PRELOAD_LAUNCHER_PREWARM_RANKS": str(ranks),
                "PRELOAD_LAUNCHER_PREWARM_CUDA": cuda}
    saved = {k: os.environ.get(k) for k in settings}
    os.environ.update(settings)
    warm = Launcher(stack)
    warm.zygote_for(dict(os.environ))
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key)
        else:
            os.environ[key] = value
    return warm


def rows(launcher: Launcher, stack: list[str], gpus: int, args) -> list[dict]:
    warm = prewarmed_launcher(stack, 0)
    out = []
    header = (f"{'step':50} {'subprocess':>10} {'launcher':>9} {'prewarm':>8} {'in-proc':>8} "
              f"{'ratio':>6} {'overhead':>8}")
    print(header)
    print("-" * len(header))
    for name, cmd in workloads(gpus):
        if args.only not in name:
            continue
        sub = [time_subprocess(cmd) for _ in range(args.steps)]
        ours = [time_launcher(launcher, cmd) for _ in range(args.steps)]
        warmed = [time_launcher(warm, cmd) for _ in range(args.steps)]
        inproc = time_inprocess(cmd, args.steps)
        row = {"step": name, "subprocess_s": statistics.median(sub),
               "launcher_s": statistics.median(t for t, _ in ours),
               "prewarm_s": statistics.median(t for t, _ in warmed),
               "inprocess_s": statistics.median(inproc) if inproc else None,
               "overhead_ms": 1000 * statistics.median(d for _, d in ours),
               "subprocess_runs": sub, "launcher_runs": [t for t, _ in ours],
               "prewarm_runs": [t for t, _ in warmed], "inprocess_runs": inproc}
        row["ratio"] = row["subprocess_s"] / row["launcher_s"]
        out.append(row)
        inproc_text = f"{row['inprocess_s']:7.3f}s" if inproc else "   fails"
        print(f"{name:50} {row['subprocess_s']:9.2f}s {row['launcher_s']:8.3f}s "
              f"{row['prewarm_s']:7.3f}s {inproc_text} {row['ratio']:5.1f}x "
              f"{row['overhead_ms']:6.1f}ms", flush=True)
    print("\noverhead = request sent -> first line of user code in the child (medians); "
          "in-proc = steady-state re-runs in one process, no isolation")
    warm.close()
    return out


if __name__ == "__main__":
    main()
