"""What a zygote's preload did, as lines for people: shared by the CLI (`doctor`, `status`,
`run -v`) and the pytest summary, so that each names a module's outcome the same way."""

from __future__ import annotations

__all__ = ["format_doctor", "format_deferred", "format_learned", "doctor_verdict",
           "not_installed", "entry_result", "preload_problems"]


def not_installed(entry: dict) -> bool:
    """The entry's module (or a package above it) is not installed: nothing of it ran."""
    missing = entry.get("missing", "")
    return (not entry["ok"] and entry["error"].startswith("ModuleNotFoundError") and bool(missing)
            and (entry["module"] == missing or entry["module"].startswith(missing + ".")))


def entry_result(entry: dict) -> str:
    if entry["ok"]:
        return "ok"
    return "not installed (skipped)" if not_installed(entry) else f"FAILED: {entry['error'][:100]}"


def preload_problems(report: dict, named_in: str = "") -> list[str]:
    """Lines about the entries that were not preloaded. ``named_in``: where the preload list
    came from ("" for the default list). A module of the default list that is not installed is
    left out (the default names the whole stack, and an install may hold part of it); one the
    user named is a warning, with the error and where it was named."""
    missing = [e for e in report.get("entries", []) if not_installed(e)]
    failed = [e for e in report.get("entries", []) if not e["ok"] and e not in missing]
    lines = []
    for e in missing if named_in else []:
        lines.append(f"not importable: {e['module']} ({e['error'][:100]}), named in {named_in}")
    for e in failed:
        lines.append(f"failed to import: {e['module']} ({e['error'][:100]})")
    return lines


def format_doctor(status: dict) -> str:
    report = status.get("preload", {})
    lines = [f"zygote pid {status.get('pid')} ({status.get('python')}), probe: {report.get('probe')}, "
             f"NVML answers during import: {report.get('nvml_answers')}",
             f"preload took {report.get('seconds')} s; requested: {', '.join(report.get('requested', []))}",
             "", f"{'module':32} {'time':>7}  {'torch CUDA':10} {'driver':8} {'threads+':8} result"]
    for e in report.get("entries", []):
        lines.append(f"{e['module']:32} {e['seconds']:6.2f}s  {str(e['torch_cuda_initialized']):10} "
                     f"{str(e['driver_initialized']):8} {e['native_threads_added']:<8} "
                     f"{entry_result(e)}")
        if e["python_threads"]:
            lines.append(f"{'':32} python threads started: {', '.join(e['python_threads'])}")
    for entry, verdict in report.get("quarantined", {}).items():
        lines.append(f"QUARANTINED {entry}: {verdict['reason']}; culprit {verdict['culprit']} via "
                     f"{' -> '.join(verdict['chain'])}")
    lines.extend(format_deferred(report.get("deferred", {})))
    lines.append("")
    lines.append(f"final preload set: {', '.join(report.get('loaded', [])) or '(none)'}")
    lines.append(format_learned(report.get("learned", {})))
    threads = status.get("native_threads", {})
    lines.append(f"native threads at fork time: {sum(threads.values())} "
                 f"({', '.join(f'{k}×{v}' for k, v in sorted(threads.items()))})")
    for row in status.get("native_threads_described", []):
        lines.append(f"  {row['count']:3} × {row['what']}: fork-safe: {row['fork_safe']}")
    lines.append(f"zygote RSS: {status.get('rss_kb', 0) / 1024:.0f} MiB")
    return "\n".join(lines)


def format_deferred(deferred: dict, indent: str = "") -> list[str]:
    """Deferred packages: why, and the guarded imports each step replays."""
    lines = []
    for package, info in deferred.items():
        lines.append(f"{indent}DEFERRED {package}: {info['reason']}; culprit {info['culprit']} via "
                     f"{' -> '.join(info['chain'])}; {info.get('entry', 'its importer')} stays "
                     "preloaded")
        for cut in info.get("cut", []):
            names = ", ".join(cut["fromlist"])
            what = f"from {cut['module']} import *" if names == "*" else f"import {cut['module']}"
            lines.append(f"{indent}  replayed in steps: {what} (in {cut['importer']})"
                         + (f", binding {names}" if names and names != "*" else ""))
    return lines


def format_learned(learned: dict) -> str:
    if not learned:
        return "learned preload: off (PRELOAD_LAUNCHER_LEARN=0)"
    if "disabled" in learned:
        return f"learned preload: disabled ({learned['disabled']})"
    text = (f"learned preload: {learned['loaded']} of {learned['listed']} modules that earlier "
            f"steps imported, {learned['seconds']:.1f} s at start-up")
    if learned.get("over_budget"):
        text += f", {learned['over_budget']} left out by the budget"
    if learned.get("quarantined"):
        text += f"; quarantined: {', '.join(learned['quarantined'])}"
    return text


def doctor_verdict(report: dict, named_in: str = "") -> tuple[str, int]:
    """The last line of doctor and its exit status: a module the user named (``named_in``, as
    for ``preload_problems``) that is not installed is a warning (one of the default list has
    its row only); a quarantine or another import failure is a failure."""
    absent = [e["module"] for e in report["entries"] if not_installed(e)]
    missing = absent if named_in else []
    failed = [f"{e['module']} ({e['error'][:80]})" for e in report["entries"]
              if not e["ok"] and e["module"] not in absent]
    quarantined = [f"{name} ({verdict['reason']})" for name, verdict in report["quarantined"].items()]
    problems = quarantined and [f"quarantined: {'; '.join(quarantined)}"] or []
    problems += failed and [f"failed to import: {'; '.join(failed)}"] or []
    warning = f"; not installed (skipped): {', '.join(missing)}" if missing else ""
    if problems:
        return f"doctor: FAIL: {'; '.join(problems)}{warning}", 1
    return (f"doctor: OK: {len(report['loaded'])} of {len(report['requested'])} preloaded"
            f"{warning}"), 0
