"""Settings a fresh interpreter takes from its environment at start-up, by CPython's rules.

Some can be applied in a forked child (buffering, the locale, tracemalloc); the ones
``sys.flags`` fixes at start-up (``-O``, dev mode, verbose imports, UTF-8 mode, ...) cannot:
a step that asks for other values than the zygote was started with is served by a zygote
started with them (the client compares ``startup_flags``) or, failing that, runs as a plain
process (``startup_mismatch`` in the child says why).
"""

from __future__ import annotations

import functools
import json
import os
import sys
from typing import Mapping, Optional

from .settings import THREAD_ENV

__all__ = ["env_flag", "env_value", "startup_flags", "zygote_flags", "flags_differ", "import_env_mismatch",
           "startup_mismatch",
           "FLAG_PREFIX", "USER_SITE_KEY", "user_site", "zygote_user_site", "take_user_base",
           "apply_locale", "ctype_is_c_like", "step_base_path"]

ZYGOTE_CWD = "/"  # where a zygote starts, resolving relative PYTHONPATH entries against it
FLAG_PREFIX = "sys.flags."  # how start-up flags are named among a zygote's import environment
USER_SITE_KEY = "site.USER_SITE"  # the user site-packages on sys.path, among the same

# Locales where python defaults stdio errors to surrogateescape (its coercion targets too).
C_LIKE_LOCALES = ("C", "POSIX", "C.UTF-8", "C.utf8", "UTF-8")


def _value(env: Mapping[str, str], name: str) -> Optional[str]:
    return env.get(name) or None  # python treats an empty variable as unset


def env_flag(env: Mapping[str, str], name: str) -> int:
    """A numeric flag variable as python reads it (``PYTHONOPTIMIZE=2`` -> 2, text -> 1,
    ``0`` -> 0, unset or empty -> 0)."""
    value = _value(env, name)
    if value is None:
        return 0
    try:
        number = int(value)
    except ValueError:
        return 1
    return number if number >= 0 else 1


def _utf8_mode(env: Mapping[str, str], ctype_locale: Optional[str]) -> Optional[int]:
    """PEP 540: ``PYTHONUTF8``, else on when the start-up locale is C/POSIX; None when only
    the locale (known in the child, after ``apply_locale``) can tell."""
    value = _value(env, "PYTHONUTF8")
    if value in ("0", "1"):
        return int(value)
    if ctype_locale is None:
        return None
    return int(ctype_locale in ("C", "POSIX"))


def startup_flags(env: Mapping[str, str], ctype_locale: Optional[str] = None) -> dict[str, int]:
    """The ``sys.flags`` a fresh interpreter started with ``env`` would show, for the flags an
    environment variable sets. ``ctype_locale``: the LC_CTYPE locale ``env`` selects (before
    coercion), where known."""
    flags = {"optimize": env_flag(env, "PYTHONOPTIMIZE"),
             "verbose": env_flag(env, "PYTHONVERBOSE"),
             "dev_mode": int(_value(env, "PYTHONDEVMODE") is not None)}
    if hasattr(sys.flags, "warn_default_encoding"):
        flags["warn_default_encoding"] = int(_value(env, "PYTHONWARNDEFAULTENCODING") is not None)
    if hasattr(sys.flags, "int_max_str_digits"):
        digits = _value(env, "PYTHONINTMAXSTRDIGITS")
        default = -1 if sys.version_info < (3, 12) else sys.int_info.default_max_str_digits
        flags["int_max_str_digits"] = int(digits) if digits and digits.isdigit() else default
    utf8 = _utf8_mode(env, ctype_locale)
    if utf8 is not None:
        flags["utf8_mode"] = utf8
    return flags


def zygote_flags(keys=None) -> dict[str, int]:
    """This interpreter's own values of ``keys`` (names of ``sys.flags`` fields; default: all
    that ``startup_flags`` knows)."""
    if keys is None:
        keys = [*startup_flags({}), "utf8_mode"]
    return {key: int(getattr(sys.flags, key)) for key in keys}


def _ctype_name(env: Mapping[str, str]) -> str:
    """The LC_CTYPE locale ``env`` names (without asking the C library whether it exists)."""
    return env.get("LC_ALL") or env.get("LC_CTYPE") or env.get("LANG") or "C"


def flags_differ(recorded: Mapping[str, Optional[int]], env: Mapping[str, str]) -> list[str]:
    """Among a zygote's ``recorded`` start-up flags (named with ``FLAG_PREFIX``), those a fresh
    interpreter started with ``env`` would show otherwise."""
    wanted = startup_flags(env, _ctype_name(env))
    return [key for key, value in recorded.items()
            if key.startswith(FLAG_PREFIX) and wanted.get(key[len(FLAG_PREFIX):], value) != value]


def _user_base(env: Mapping[str, str]) -> str:
    """``site.USER_BASE`` of a fresh interpreter started with ``env`` (site's rule on posix:
    ``PYTHONUSERBASE``, else ``~/.local`` with ``HOME``'s ``~``)."""
    base = env.get("PYTHONUSERBASE")
    if base:
        return base
    home = env.get("HOME") or os.path.expanduser("~")  # (unset: the password database's)
    return os.path.join(home, ".local")


def user_site(env: Mapping[str, str]) -> Optional[str]:
    """The user site-packages folder a fresh interpreter started with ``env`` puts on
    ``sys.path`` (None: none), by site's rules (not this process's own ``-s``: a stand-in runs
    with ``-I``)."""
    import site
    folder = site._get_path(_user_base(env))  # type: ignore[attr-defined]
    enabled = (not env.get("PYTHONNOUSERSITE") and os.geteuid() == os.getuid()
               and os.getegid() == os.getgid() and not _venv_without_system_site())
    return folder if enabled and os.path.isdir(folder) else None


@functools.lru_cache(maxsize=None)
def _venv_without_system_site() -> bool:
    """site's rule: a virtual environment (``pyvenv.cfg`` beside the executable or a folder up)
    that does not include the system's site-packages has no user site either."""
    here = os.path.dirname(os.path.abspath(sys.executable))
    for folder in (here, os.path.dirname(here)):
        try:
            with open(os.path.join(folder, "pyvenv.cfg"), encoding="utf-8") as cfg:
                lines = cfg.read().splitlines()
        except OSError:
            continue
        for line in lines:
            key, sep, value = line.partition("=")
            if sep and key.strip().lower() == "include-system-site-packages":
                return value.strip().lower() != "true"
        return False  # (site's default: included)
    return False


def zygote_user_site() -> Optional[str]:
    """This interpreter's user site-packages folder, if its start put one on ``sys.path``."""
    import site
    return site.USER_SITE if site.ENABLE_USER_SITE and site.USER_SITE in sys.path else None


def take_user_base() -> None:
    """In a step (its environment in place): ``site``'s and ``sysconfig``'s user base as a
    fresh start computes it from ``HOME``/``PYTHONUSERBASE`` (``pip install --user`` installs
    there). Whether a user site is on ``sys.path`` keys the zygote (``USER_SITE_KEY``)."""
    import site
    base = _user_base(os.environ)
    if base == site.USER_BASE:
        return
    site.USER_BASE, site.USER_SITE = base, site._get_path(base)  # type: ignore[attr-defined]
    import sysconfig
    config = getattr(sysconfig, "_CONFIG_VARS", None)
    if config and "userbase" in config:  # worked out already: cached, as in the zygote
        config["userbase"] = base


def env_value(env: Mapping[str, str], key: str) -> Optional[str]:
    """``key``'s value in ``env``; for a family ``X*`` (``settings.NATIVE_ENV``), every variable
    named X... (thread counts aside) as one string, None when there is none."""
    if not key.endswith("*"):
        return env.get(key)
    family = sorted((k, v) for k, v in env.items()
                    if k.startswith(key[:-1]) and k not in THREAD_ENV)
    return json.dumps(family) if family else None


def import_env_mismatch(import_env: Mapping[str, Optional[str]], env: Mapping[str, str],
                        set_while_importing: Optional[Mapping[str, str]] = None) -> list[str]:
    """The import-relevant variables whose value in ``env`` differs from a preload's
    (``preload.import_env``), and the start-up flags (``sys.flags.X``) a fresh interpreter
    would take otherwise from ``env``: a zygote serves only steps where this is empty. A
    variable the preload's imports set themselves (unset before), or read unset with one
    default (``envreads.read_default``), may hold that value (``set_while_importing``)."""
    flags = FLAG_PREFIX
    set_by_imports = set_while_importing or {}
    user = [USER_SITE_KEY] if (USER_SITE_KEY in import_env
                               and user_site(env) != import_env[USER_SITE_KEY]) else []
    return sorted([k for k, v in import_env.items()
                   if not k.startswith(flags) and k != USER_SITE_KEY and env_value(env, k) != v
                   and not (v is None and k in set_by_imports and env_value(env, k) == set_by_imports[k])]
                  + flags_differ(import_env, env) + user)


def startup_mismatch(env: Mapping[str, str], ctype_locale: Optional[str]) -> list[str]:
    """The start-up flags ``env`` asks for that this (forked) interpreter does not have."""
    wanted = startup_flags(env, ctype_locale)
    have = zygote_flags(wanted)
    return [f"{FLAG_PREFIX}{key}={wanted[key]}" for key in wanted if wanted[key] != have[key]]


def _locale_from_env() -> str:
    """Set LC_CTYPE from the environment, as python does at start-up (a locale that does not
    exist leaves "C"); returns its name."""
    import locale  # the child's business: the client's start-up need not pay for it
    try:
        return locale.setlocale(locale.LC_CTYPE, "")
    except locale.Error:
        return locale.setlocale(locale.LC_CTYPE, "C")


def apply_locale(coerce) -> str:
    """Python's start-up: read LC_CTYPE from the environment; under C/POSIX apply PEP 538's
    coercion (``coerce`` sets ``LC_CTYPE`` in the environment when it applies) and read it
    again. Returns the locale before coercion (what UTF-8 mode depends on)."""
    before = _locale_from_env()
    if before in ("C", "POSIX") and coerce():
        _locale_from_env()
    return before


def ctype_is_c_like() -> bool:
    import locale
    return locale.setlocale(locale.LC_CTYPE) in C_LIKE_LOCALES


def _path_key(path: str) -> str:
    """Paths as ``site`` compares them (``//src``, which getpath makes from cwd ``/``, is
    ``/src``)."""
    normal = os.path.normpath(path)
    return "/" + normal.lstrip("/") if normal.startswith("/") else normal


def step_base_path(base_path: list[str], pythonpath: str, zygote_cwd: str, cwd: str) -> list[str]:
    """``base_path`` (the zygote's sys.path without sys.path[0]) with ``PYTHONPATH``'s entries
    resolved against the step's ``cwd``, as a fresh interpreter started there resolves them,
    instead of the zygote's start-up directory; duplicates dropped as ``site`` drops them."""
    entries = pythonpath.split(os.pathsep) if pythonpath else []
    if cwd == zygote_cwd or all(os.path.isabs(e) for e in entries):
        return base_path
    zygotes = {_path_key(os.path.join(zygote_cwd, e)) for e in entries}
    at = next((i for i, p in enumerate(base_path) if _path_key(p) in zygotes), 0)
    kept = [p for p in base_path if _path_key(p) not in zygotes]
    path = kept[:at] + [os.path.abspath(os.path.join(cwd, e)) for e in entries] + kept[at:]
    seen: set[str] = set()
    return [p for p in path if not (_path_key(p) in seen or seen.add(_path_key(p)))]
