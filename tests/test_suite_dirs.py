"""The suite keeps to its own directories: the zygote the plugin starts for the session (before
any conftest loads) sees the suite's runtime directory and cache, never the user's."""
import ast
import os
import pathlib

import suite_dirs


def test_the_sessions_zygote_uses_the_suites_directories(preload_launcher):
    zygote = preload_launcher.zygotes[0]
    with open(f"/proc/{zygote.process.pid}/environ", "rb") as f:
        env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
    root = suite_dirs.ROOT.encode()
    assert env[b"XDG_RUNTIME_DIR"] == root + b"/run"
    assert env[b"PRELOAD_LAUNCHER_CACHE_DIR"] == root + b"/cache"
    assert zygote.socket_path.startswith(os.path.join(suite_dirs.ROOT, "run", ""))


def test_a_short_dir_holds_the_longest_socket_path_whatever_tmpdir_is():
    from preload_launcher.rundir import LONGEST_SOCKET_NAME, MAX_SOCKET_PATH
    runtime = os.path.join(suite_dirs.short_dir(), f"preload_launcher-{2**32 - 1}")
    assert len(os.fsencode(runtime)) + 1 + LONGEST_SOCKET_NAME <= MAX_SOCKET_PATH


TEMPORARY = {"tmp_path", "tmp_path_factory", "gettempdir"}  # their length follows TMPDIR & co.


def runtime_dirs_from_temporary(source: str) -> list[str]:
    """Functions of ``source`` that set ``XDG_RUNTIME_DIR`` from a name in ``TEMPORARY``,
    following the function's own assignments (``path = tmp_path / "run"``)."""
    found = []
    for func in ast.walk(ast.parse(source)):
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        made_of = {}  # name -> the names its value was made of
        for node in ast.walk(func):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        made_of.setdefault(target.id, set()).update(names_in(node.value))
        values = [kw.value for node in ast.walk(func) if isinstance(node, ast.Call)
                  for kw in node.keywords if kw.arg == "XDG_RUNTIME_DIR"]
        values += [node.value for node in ast.walk(func) if isinstance(node, ast.Assign)
                   and any(isinstance(t, ast.Subscript) and isinstance(t.slice, ast.Constant)
                           and t.slice.value == "XDG_RUNTIME_DIR" for t in node.targets)]
        for value in values:
            seen, todo = set(), names_in(value)
            while todo:
                name = todo.pop()
                if name not in seen:
                    seen.add(name)
                    todo |= made_of.get(name, set())
            if seen & TEMPORARY and func.name not in found:
                found.append(func.name)
    return found


def names_in(node) -> set:
    return {n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(node)
            if isinstance(n, (ast.Name, ast.Attribute))}


def test_no_test_keeps_its_sockets_under_tmp_path():
    """Every runtime directory a test sets comes from ``runtime_base`` / ``short_dir`` (or a
    fixed short path): one under tmp_path fits a socket only where TMPDIR and the user's name
    are short (with TMPDIR 5 characters longer than /tmp, or a user named runner-01, a dozen
    tests failed)."""
    tests = pathlib.Path(__file__).parent
    found = {str(path.relative_to(tests)): runtime_dirs_from_temporary(path.read_text())
             for path in sorted(tests.rglob("*.py"))}
    assert {path: funcs for path, funcs in found.items() if funcs} == {}
    assert runtime_dirs_from_temporary(  # and the check sees one
        "def f(tmp_path):\n    p = tmp_path / 'run'\n    e = dict(XDG_RUNTIME_DIR=str(p))\n") \
        == ["f"]
