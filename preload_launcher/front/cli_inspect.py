"""``preload-launcher doctor|learned|profile``: what the preload does, what was learned, and a
portable profile of both."""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

from .. import settings
from ..caller.zygote_handle import ZygoteProcess
from ..files import read_json
from ..result import LauncherError
from ..zygote import learn
from ..zygote.profiles import write_profile
from ..zygote.verdicts import SCOUTED, VerdictCache, package_fingerprint
from .reporting import doctor_verdict, format_doctor

__all__ = ["cmd_doctor", "cmd_learned", "cmd_profile"]


def cmd_doctor(args: argparse.Namespace) -> int:
    modules = settings.preload_modules(args.preload)
    zygote = ZygoteProcess(modules, os.environ)
    try:
        status = zygote.start(progress=sys.stderr if sys.stderr.isatty() else None).status
    except LauncherError as err:
        print(f"preload-launcher doctor: {err}", file=sys.stderr)
        return 1
    finally:
        zygote.close()
    print(json.dumps(status, indent=1) if args.json else format_doctor(status))
    verdict, code = doctor_verdict(status["preload"], settings.preload_source(args.preload))
    print(verdict)
    return code


def cmd_learned(args: argparse.Namespace) -> int:
    """Show, pin or forget what the learned preload keeps for this project and environment."""
    project = os.path.abspath(args.project or os.getcwd())
    profile = learn.Profile(settings.Settings.from_env().cache_dir, learn.profile_key(project), project)
    profile.merge_reports()
    for module in args.pin or []:
        profile.pin(module)
    for module in args.forget or []:
        profile.forget(module)
    if args.clear:
        profile.clear()
    if not profile.save() and (args.pin or args.forget or args.clear):
        return 1  # the reason is printed already
    modules = profile.data["modules"]
    print(f"profile {profile.path} (project {project})")
    print(f"{len(modules)} learned, pinned: {', '.join(profile.data['pinned']) or '-'}, "
          f"forgotten: {', '.join(profile.data['forgotten']) or '-'}")
    costly = sorted(modules, key=lambda m: -(modules[m]["seconds"] or 0))[:args.top]
    for name in costly:
        seconds = modules[name]["seconds"]
        print(f"  {name:50} seen {modules[name]['count']:4}x  "
              f"{'%.3f s' % seconds if seconds is not None else 'not preloaded yet'}")
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    """Write a portable profile: this package set's verdicts and the learned modules, saying
    what it found where, and warning when there was nothing to write."""
    s = settings.Settings.from_env()
    project = os.path.abspath(args.project or os.getcwd())
    fingerprint = package_fingerprint(sys.path[1:])  # as the zygote sees them: no sys.path[0]
    cache = VerdictCache(s.cache_dir, f"{fingerprint}-{s.probe}")
    verdicts = {k: v for k, v in cache.get().items() if not v.get("cleared")}
    learned = learn.Profile(s.cache_dir, learn.profile_key(project), project)
    reports = learned.merge_reports()
    learned.save()
    write_profile(args.write, fingerprint, s.probe, verdicts, list(learned.data["modules"]),
                  list(learned.data["pinned"]))
    found = sorted(k for k in verdicts if not k.startswith(SCOUTED))
    print(f"preload-launcher: found {len(verdicts)} verdicts for this package set in {cache.path}; "
          f"learned profile {learned.path} ({len(learned.data['modules'])} modules, "
          f"{reports} new step reports)")
    for path, other in _other_profiles(learned):
        print(f"preload-launcher: not used: {path} ({len(other.get('modules', {}))} modules, "
              f"project {other.get('project')}, another interpreter or environment)")
    print(f"preload-launcher: wrote {args.write}: {len(found)} verdicts "
          f"({', '.join(found) or 'none'}), {len(verdicts) - len(found)} entries known clean, "
          f"{len(learned.data['modules'])} learned modules, package fingerprint {fingerprint}")
    if not verdicts and not learned.data["modules"]:
        print(f"preload-launcher profile: warning: {args.write} is empty: nothing was found or "
              f"learned for this interpreter ({sys.executable}) and project ({project}); run the "
              "steps (the test session) with this environment first", file=sys.stderr)
    return 0


def _other_profiles(mine: learn.Profile) -> list[tuple[str, dict]]:
    """Learned profiles for the same project kept under another interpreter's key."""
    found = []
    for path in sorted(glob.glob(os.path.join(mine.dir, "*.json"))):
        data = read_json(path)
        if path != mine.path and data and data.get("project") == mine.project:
            found.append((path, data))
    return found
