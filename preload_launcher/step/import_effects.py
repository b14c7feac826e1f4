"""What a preloaded module's import registers interpreter-wide — warning filters, exit
handlers, loggers and the environment variables it sets — is a step's only once the step
imports that module, as a fresh import would register it then.

The stack registers both at import (torch: filters for numpy's size-changed messages and its
tracer, a handful of exit handlers; megatron.core and modelopt their own). Left in place, a
step that never imports torch would see torch's filters (and python's
``default::DeprecationWarning:__main__`` no longer first) and run torch's exit handlers.

In the zygote (``recording``): each registration a module's import makes is recorded as the call
it was, against the module being imported, in the order made: ``warnings._add_filter`` (what
``filterwarnings`` and ``simplefilter`` call), ``atexit.register``, ``os.environ[key] =``
(inductor's ``TORCHINDUCTOR_CACHE_DIR``: a step that never imports it, and the processes it
starts, must not have it; replayed unless the step has set it) and the first
``tempfile.gettempdir()``, which settles the temporary folder once, from ``TMPDIR`` of that
moment (torch._dynamo's import asks for it). A filter set inside a ``catch_warnings`` block goes
to that block's own list (which the block discards) and is not recorded. In a step
(``start_fresh``, before its own options apply): the filters are the zygote's before its
preload (python's defaults and ``PYTHONWARNINGS``, on which a zygote and its steps agree), the
recorded exit handlers are unregistered and the temporary folder is unsettled; handing modules back
(``bring_back``) replays their calls, in their order, after what the step has registered itself.

Filters are reset only where replaying every recorded call on the zygote's starting filters
gives the zygote's filters (no module changed ``warnings.filters`` by hand); otherwise steps
keep the zygote's filters (a known difference).

Loggers: the ones a module's import made (``logging.getLogger``) are recorded against it, and a
step starts without them and without the launcher's own (out of ``loggerDict``, the hierarchy
mended as ``logging.Manager`` mends it): ``logging.config``'s ``disable_existing_loggers``, the
default of ``dictConfig`` and ``fileConfig``, disables the loggers that exist when it runs, and
a program that configures logging before ``import torch`` gets torch's loggers enabled. A
module handed back brings back its loggers (the objects it holds); ``getLogger`` of such a name
before that brings it back too, so there is never a second logger of one name. Records'
``relativeCreated`` counts from the step's start (a fresh process's logging is that young).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import itertools
import logging
import os
import sys
import tempfile
import time
import warnings
import weakref
from typing import Callable, Iterator, Optional

__all__ = ["recording", "prepare", "start_fresh", "bring_back"]

# module -> its import's registrations: (sequence number, replay function, args, kwargs)
_calls: dict[str, list[tuple]] = {}
_sequence = itertools.count()
_start_filters: Optional[list] = None  # before the first recording: python's, PYTHONWARNINGS
_filters_replayable = False
_exit_handlers: list[Callable] = []  # every recorded one, to unregister in a step
_recorder: Optional[Callable] = None  # set while recording: (replay function, args, kwargs)
_loggers: dict[str, list[str]] = {}  # module -> the loggers its import made, by name
_hidden: dict[str, logging.Logger] = {}  # in a step: preloaded loggers it has not made yet
_manager = logging.Logger.manager
env_set_by_modules: set[str] = set()  # variables a recorded import set (replayed with it)
_tempdir_by_import = False  # a preloaded import made tempfile settle its folder (``recording``)
_get_logger = type(_manager).getLogger.__get__(_manager)  # python's own


def _add_filter(*item, append):
    return warnings._add_filter(*item, append=append)  # type: ignore[attr-defined]


@functools.wraps(atexit.register)
def _register(func, *args, **kwargs):
    """``atexit.register`` while the zygote imports; python's own after (a module may keep it).
    The standard library's own registrations stay (``weakref.finalize`` registers its handler
    once per process, whichever module makes the first finalizer)."""
    caller = sys._getframe(1).f_globals.get("__name__") or ""
    if _recorder is not None and caller.partition(".")[0] not in sys.stdlib_module_names:
        _recorder(atexit.register, (func, *args), kwargs)
        _exit_handlers.append(func)
    return _real_register(func, *args, **kwargs)


_real_register = atexit.register


@contextlib.contextmanager
def recording(importing: Callable[[object], Optional[str]]) -> Iterator[None]:
    """Record the registrations made inside against ``importing(frame)``, the module being
    imported (``module_table``)."""
    global _start_filters, _recorder
    if _start_filters is None:
        _start_filters = list(warnings.filters)
    watched = warnings.filters  # a catch_warnings block swaps in a copy of its own
    add = warnings._add_filter  # type: ignore[attr-defined]

    def record(replay: Callable, args: tuple, kwargs: dict) -> None:
        module = importing(sys._getframe(2))
        if module is not None:
            _calls.setdefault(module, []).append((next(_sequence), replay, args, kwargs))

    def recording_add_filter(*item, append):
        if warnings.filters is watched:
            record(_add_filter, item, {"append": append})
        return add(*item, append=append)

    def recording_get_logger(name):
        made = not isinstance(_manager.loggerDict.get(name), logging.Logger)
        logger = _get_logger(name)
        module = importing(sys._getframe(1)) if made else None
        if module is not None:
            _loggers.setdefault(module, []).append(name)
        return logger

    environ_type = type(os.environ)
    set_item = environ_type.__setitem__

    def recording_set_item(environ, key, value):
        if environ is not os.environ:
            return set_item(environ, key, value)
        # Whether it replaced a value: looked up in the mapping's own store, which is no read
        # of the variable (``in`` would be one, ``envreads``).
        replaced = environ.encodekey(key) in environ._data
        set_item(environ, key, value)
        module = importing(sys._getframe(1))
        if module is not None:
            _calls.setdefault(module, []).append(
                (next(_sequence), _set_env, (key, value, replaced), {}))
            env_set_by_modules.add(key)

    warnings._add_filter = recording_add_filter  # type: ignore[attr-defined]
    tempfile._get_default_tempdir = _recording_tempdir(importing)  # type: ignore[attr-defined]
    atexit.register, _recorder = _register, record
    environ_type.__setitem__ = recording_set_item
    outer = _manager.__dict__.get("getLogger")  # an enclosing recording's (learned modules)
    _manager.getLogger = recording_get_logger  # logging.getLogger calls the manager's
    try:
        yield
    finally:
        warnings._add_filter = add  # type: ignore[attr-defined]
        tempfile._get_default_tempdir = tempfile._get_default_tempdir.__wrapped__  # type: ignore
        atexit.register, _recorder = _real_register, None
        environ_type.__setitem__ = set_item
        if outer is None:
            del _manager.getLogger
        else:
            _manager.getLogger = outer


def _recording_tempdir(importing: Callable[[object], Optional[str]]) -> Callable[[], str]:
    """What ``tempfile.gettempdir()`` caches on its first call, from ``TMPDIR`` & co. of that
    moment: made by an import, the call is made again when a step imports that module."""
    default_tempdir = tempfile._get_default_tempdir  # type: ignore[attr-defined]

    @functools.wraps(default_tempdir)
    def recording_default_tempdir():
        global _tempdir_by_import
        found = default_tempdir()
        module = importing(sys._getframe(1))
        if module is not None:
            _calls.setdefault(module, []).append((next(_sequence), tempfile.gettempdir, (), {}))
            _tempdir_by_import = True
        return found
    return recording_default_tempdir


_set_now: dict[str, str] = {}  # what the replay in progress set


def _set_env(key: str, value: str, replaced: bool = False) -> None:
    """An import's ``os.environ[key] = value`` again. One that replaced a value in the zygote
    replaces the step's too, as it does in a fresh interpreter; one that filled an unset
    variable leaves a value of the step's own (it may have been ``setdefault``, or a test the
    recording could not see)."""
    if replaced or key not in os.environ:
        os.environ[key] = _set_now[key] = value


def _replay(calls: list[tuple]) -> None:
    for _, replay, args, kwargs in sorted(calls, key=lambda call: call[0]):
        replay(*args, **kwargs)


def prepare() -> None:
    """In the zygote, once its modules are there: can a step's filters be worked out? (Worked
    out in a ``catch_warnings`` block, which puts the zygote's own filters back.)"""
    global _filters_replayable
    filters = [call for calls in _calls.values() for call in calls if call[1] is _add_filter]
    with warnings.catch_warnings():
        warnings.filters[:] = _start_filters or []
        _replay(filters)
        replayed = list(warnings.filters)
    _filters_replayable = _start_filters is not None and replayed == warnings.filters


def start_fresh() -> None:
    """In a step, before its own options apply: no preloaded module's registrations."""
    if _filters_replayable:
        warnings.filters[:] = _start_filters
        warnings._filters_mutated()  # type: ignore[attr-defined]
    for func in _exit_handlers:
        atexit.unregister(func)
    if _tempdir_by_import:  # settled again from the step's environment at its first use
        tempfile.tempdir = None
    # Every finalizer alive now finalises a zygote object: none runs at the step's exit
    # (torch.library's ~30 ms; a preloaded module's temporary folder, the zygote's own).
    for finalizer in list(weakref.finalize._registry):  # type: ignore[attr-defined]
        finalizer.atexit = False
    _hide_loggers()


def _hide_loggers() -> None:
    """The loggers preloaded imports and the launcher made leave ``loggerDict`` (see above)."""
    logging._startTime = (time.time_ns() if isinstance(logging._startTime, int)  # type: ignore
                          else time.time())
    made = {name for names in _loggers.values() for name in names}
    made |= {name for name in _manager.loggerDict if name.partition(".")[0] == "preload_launcher"}
    with logging._lock:  # type: ignore[attr-defined]
        for name in made:
            logger = _manager.loggerDict.pop(name, None)
            if isinstance(logger, logging.Logger):
                _hidden[name] = logger
        for name, item in list(_manager.loggerDict.items()):  # placeholders for hidden ones
            if isinstance(item, logging.PlaceHolder):
                for logger in [lg for lg in item.loggerMap if lg.name in _hidden]:
                    del item.loggerMap[logger]
                if not item.loggerMap:
                    del _manager.loggerDict[name]
        for item in list(_manager.loggerDict.values()):
            if isinstance(item, logging.Logger) and _hidden.get(item.parent.name) is item.parent:
                _manager._fixupParents(item)  # type: ignore[attr-defined]
        # levels the loggers worked out under their old parents
        _manager._clear_cache()  # type: ignore[attr-defined]
    _manager.getLogger = _revealing_get_logger


def _revealing_get_logger(name):
    if name in _hidden:
        _reveal(name)
    return _get_logger(name)


def _reveal(name: str) -> None:
    """A hidden logger back in ``loggerDict``, as ``Manager.getLogger`` adds one it made."""
    with logging._lock:  # type: ignore[attr-defined]
        logger = _hidden.pop(name, None)
        if logger is None or isinstance(_manager.loggerDict.get(name), logging.Logger):
            return
        placeholder = _manager.loggerDict.get(name)
        _manager.loggerDict[name] = logger
        if isinstance(placeholder, logging.PlaceHolder):
            _manager._fixupChildren(placeholder, logger)  # type: ignore[attr-defined]
        _manager._fixupParents(logger)  # type: ignore[attr-defined]
        # its children's levels now go through it (and what its import set on it)
        _manager._clear_cache()  # type: ignore[attr-defined]


def bring_back(names: list[str]) -> dict[str, str]:
    """In a step: the modules ``names`` are handed back, with their imports' registrations.
    Returns the variables their imports set (not the step's doing: ``module_table``)."""
    _set_now.clear()
    _replay([call for name in names for call in _calls.get(name, ())
             if _filters_replayable or call[1] is not _add_filter])
    for logger_name in [n for name in names for n in _loggers.get(name, ())]:
        _reveal(logger_name)
    return dict(_set_now)
