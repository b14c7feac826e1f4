"""What a guarded import statement binds, and what its guard swallows, read from the importer's
code where the zygote's block made it fail (``deferral.Blocker``).

A cut import is replayed in each step (``deferral.replay``), and must do there what it would
have done in a fresh interpreter: bind the names the statement binds (``from .x import *``,
``from . import x``, ``import a.b as c``, ``m = importlib.import_module(...)``), and fail the
way it would have failed: swallowed when its guard (``try/except``, ``contextlib.suppress``,
a ``contextlib.contextmanager`` guard such as modelopt's ``import_plugin``) swallows the error,
raised when it does not. Both are read from the bytecode at the frame's current instruction,
so every spelling of a guard is covered by the interpreter's own compilation of it.
"""

from __future__ import annotations

import dis
import functools
import importlib.util
from typing import Optional

__all__ = ["bindings", "guard_of"]

_STORES = {"STORE_NAME", "STORE_GLOBAL", "STORE_FAST", "STORE_DEREF"}
_IMPORT_ERROR = {"swallows": ["builtins.ImportError"]}  # when the guard cannot be read


@functools.lru_cache(maxsize=256)  # a module's code is read once for all its blocked imports
def _instructions(code) -> list:
    # EXTENDED_ARG only widens the next instruction's argument, which dis already folded in.
    return [i for i in dis.get_instructions(code) if i.opname != "EXTENDED_ARG"]


@functools.lru_cache(maxsize=256)
def _exception_entries(code) -> Optional[list]:
    return getattr(dis.Bytecode(code), "exception_entries", None)


def _from(instructions: list, offset: int) -> int:
    """The instruction a jump to ``offset`` runs first (past any EXTENDED_ARG there)."""
    return next((i for i, ins in enumerate(instructions) if ins.offset >= offset), -1)


def _at(instructions: list, offset: int) -> int:
    """The instruction at ``offset`` (a frame's ``f_lasti`` may point into its inline caches)."""
    found = -1
    for i, instruction in enumerate(instructions):
        if instruction.offset > offset:
            break
        found = i
    return found


def bindings(frame) -> Optional[list[list[str]]]:
    """The names the import at ``frame``'s current instruction binds, as ``[name, dotted
    path of the object]`` (``["*", module]`` for a star import; ``[name, ""]`` for the result
    of a call stored in ``name``: ``m = importlib.import_module(...)``); None when unknown."""
    code = frame.f_code
    instructions = _instructions(code)
    i = _at(instructions, frame.f_lasti)
    if i < 0:
        return None
    op = instructions[i]
    if op.opname != "IMPORT_NAME":  # a call: importlib.import_module(...) or __import__(...)
        after = instructions[i + 1] if i + 1 < len(instructions) else None
        return [[after.argval, ""]] if after is not None and after.opname in _STORES else []
    level, fromlist = instructions[i - 2].argval, instructions[i - 1].argval
    name = op.argval
    if level:
        package = frame.f_globals.get("__package__") or \
            frame.f_globals.get("__name__", "").rpartition(".")[0]
        name = importlib.util.resolve_name("." * level + name, package)
    stack = [name if fromlist else name.partition(".")[0]]
    binds: list[list[str]] = []
    for instruction in instructions[i + 1:]:
        if not stack:
            break
        opname = instruction.opname
        if opname == "IMPORT_FROM":
            stack.append(f"{stack[-1]}.{instruction.argval}")
        elif opname in _STORES:
            binds.append([instruction.argval, stack.pop()])
        elif opname == "IMPORT_STAR" or "IMPORT_STAR" in (instruction.argrepr or ""):
            binds.append(["*", stack.pop()])
        elif opname in ("SWAP", "ROT_TWO"):
            n = instruction.arg if opname == "SWAP" else 2
            stack[-1], stack[-n] = stack[-n], stack[-1]
        elif opname == "POP_TOP":
            stack.pop()
        else:
            break
    return binds


def guard_of(frame) -> Optional[dict]:
    """What the handler around ``frame``'s current instruction swallows: ``{"swallows":
    [exception names]}`` for ``except`` clauses and ``suppress``, ``{"cm": ...}`` for a
    generator context manager (re-created in the step), None when no handler covers it."""
    instructions = _instructions(frame.f_code)
    handler = _handler(frame.f_code, instructions, frame.f_lasti)
    if handler is None:
        return None
    i, with_statement = handler
    if with_statement:
        return _context_manager_guard(frame, instructions, i)
    return _except_clauses(instructions, i, frame)


def _handler(code, instructions: list, lasti: int) -> Optional[tuple[int, bool]]:
    """The innermost handler covering ``lasti``: (index of its first instruction, or of the
    ``with`` statement's body for a ``with``; is it a ``with``)."""
    entries = _exception_entries(code)
    if entries is None:  # Python 3.10: the block stack, from SETUP_* and POP_BLOCK in order
        blocks: list[tuple[int, str]] = []
        for n, instruction in enumerate(instructions):
            if instruction.offset >= lasti:
                break
            if instruction.opname.startswith("SETUP_"):
                blocks.append((n, instruction.opname))
            elif instruction.opname == "POP_BLOCK" and blocks:
                blocks.pop()
        if not blocks:
            return None
        n, opname = blocks[-1]
        if opname != "SETUP_FINALLY":
            return n + 1, True
        return _from(instructions, instructions[n].argval), False
    covering = [e for e in entries if e.start <= lasti < e.end]
    if not covering:
        return None
    i = _from(instructions, covering[0].target)
    if instructions[i].opname != "PUSH_EXC_INFO":
        return i, False  # a cleanup: read as a shape not known here
    if instructions[i + 1].opname == "WITH_EXCEPT_START":
        return _from(instructions, covering[0].start), True
    return i + 1, False


def _except_clauses(instructions: list, i: int, frame) -> dict:
    """``except A:``, ``except (A, mod.B):``, several clauses (each a test that jumps to the
    next), a bare ``except:`` (no test: it swallows everything)."""
    names: list[str] = []
    while i < len(instructions):
        loaded: list = []
        j = i + (instructions[i].opname == "DUP_TOP")  # 3.10 tests a copy of the exception
        while instructions[j].opname in ("LOAD_NAME", "LOAD_GLOBAL", "LOAD_ATTR", "BUILD_TUPLE"):
            instruction = instructions[j]
            if instruction.opname == "LOAD_ATTR":
                loaded[-1] = getattr(loaded[-1], instruction.argval, None)
            elif instruction.opname != "BUILD_TUPLE":
                loaded.append(_lookup(frame, instruction.argval))
            j += 1
        test = instructions[j]
        if test.opname == "RERAISE":
            break  # no clause matched: the error goes on
        if test.opname == "JUMP_IF_NOT_EXC_MATCH":  # 3.10: the test jumps itself
            jump = test
        elif test.opname == "CHECK_EXC_MATCH":
            jump = instructions[j + 1]
        elif not loaded and test.opname == "POP_TOP":
            return {"swallows": ["builtins.BaseException"]}  # a bare ``except:``
        else:
            return dict(_IMPORT_ERROR)  # a ``finally`` or a shape not known here
        names.extend(_name_of(t) for t in loaded if isinstance(t, type))
        if "JUMP" not in jump.opname or _from(instructions, jump.argval) < 0:
            break
        i = _from(instructions, jump.argval)
    return {"swallows": names or ["builtins.ImportError"]}


def _lookup(frame, name: str):
    if name in frame.f_globals:
        return frame.f_globals[name]
    builtins = frame.f_globals.get("__builtins__")
    return (builtins if isinstance(builtins, dict) else vars(builtins)).get(name)


def _context_manager_guard(frame, instructions: list, body_start: int) -> dict:
    """The ``with`` statement's context manager, made again from the expression before its
    ``BEFORE_WITH`` (a plain call such as ``suppress(ImportError)`` or ``import_plugin("x")``):
    a live frame's value stack cannot be read from Python."""
    begin, end = _with_expression(instructions, body_start)
    manager = _evaluate(frame, instructions[begin:end]) if begin >= 0 else None
    if hasattr(manager, "_exceptions"):  # contextlib.suppress
        return {"swallows": [_name_of(t) for t in manager._exceptions]}
    func = getattr(manager, "func", None)
    if func is not None and hasattr(manager, "args"):  # contextlib.contextmanager
        first = instructions[begin]
        # Where the ``with`` stands: the guard runs again from there (its warnings name it).
        line = getattr(first, "line_number", None) or first.starts_line
        return {"cm": [func.__module__, func.__qualname__], "args": list(manager.args),
                "kwargs": dict(manager.kwds), "at": [frame.f_code.co_filename, line]}
    return dict(_IMPORT_ERROR)


_NULL = object()


def _with_expression(instructions: list, body_start: int) -> tuple[int, int]:
    """The ``with`` line's first instruction and its ``BEFORE_WITH`` (-1, -1 when not found)."""
    end = next((n for n in range(body_start, -1, -1)
                if instructions[n].opname in ("BEFORE_WITH", "SETUP_WITH")), -1)
    begin = next((n for n in range(end, -1, -1) if instructions[n].starts_line), -1)
    return (begin, end) if end >= 0 and begin >= 0 else (-1, -1)


def _evaluate(frame, instructions: list):
    """Evaluate names, attributes, constants and calls; None for anything else."""
    stack: list = []
    try:
        for instruction in instructions:
            opname, arg = instruction.opname, instruction.argval
            if opname == "PUSH_NULL" or (opname == "LOAD_GLOBAL" and
                                         (instruction.argrepr or "").startswith("NULL")):
                stack.append(_NULL)
            if opname in ("LOAD_NAME", "LOAD_GLOBAL"):
                stack.append(_lookup(frame, arg))
            elif opname in ("LOAD_ATTR", "LOAD_METHOD"):
                stack[-1] = getattr(stack[-1], arg)
            elif opname == "LOAD_CONST":
                stack.append(arg)
            elif opname in ("CALL", "CALL_FUNCTION", "CALL_METHOD"):
                args = [stack.pop() for _ in range(instruction.arg)][::-1]
                func = stack.pop()
                while func is _NULL:
                    func = stack.pop()
                if stack and stack[-1] is _NULL:
                    stack.pop()
                stack.append(func(*args))
            elif opname not in ("PRECALL", "PUSH_NULL", "NOP", "RESUME", "CACHE"):
                return None
    except Exception:
        return None
    return stack[-1] if len(stack) == 1 else None


def _name_of(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"
