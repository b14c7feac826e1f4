"""The package's shape: what importing it loads, who imports whom, where the fork and the exit
are written, and who reads the launcher's environment variables."""

import ast
import os
import re
import subprocess
import sys

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "preload_launcher")
ZYGOTE_SIDE = {"zygote", "preload", "culprits", "entries", "prewarm", "step", "runtime", "child",
               "zygote_requests", "agent", "torchrun_config", "procfs", "learn",
               "accelerate_launch"}


def sources() -> dict[str, str]:
    return {name[:-3]: open(os.path.join(PACKAGE, name)).read()
            for name in sorted(os.listdir(PACKAGE)) if name.endswith(".py")}


def package_imports(tree: ast.AST) -> list[tuple[str, bool]]:
    """(imported package module, imported inside a function) for every relative import."""
    found = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.ImportFrom) and child.level == 1:
                names = [child.module] if child.module else [a.name for a in child.names]
                found.extend((n.split(".")[0], in_function) for n in names)
            visit(child, nested)

    visit(tree, False)
    return found


def loaded_by(code: str) -> set[str]:
    """The package's modules that ``code`` loads in a fresh interpreter."""
    out = subprocess.run(
        [sys.executable, "-c", f"import sys; {code}; "
         "print(' '.join(m for m in sys.modules if m.startswith('preload_launcher.')))"],
        capture_output=True, text=True, check=True).stdout.split()
    return {m.split(".", 1)[1] for m in out}


def test_importing_the_package_loads_only_the_callers_side():
    loaded = loaded_by("import preload_launcher; preload_launcher.run")
    assert "client" in loaded and not loaded & ZYGOTE_SIDE, loaded


def test_a_run_without_a_daemon_loads_neither_the_client_nor_the_zygote_side():
    """The console script's import path and `run`'s own, before it knows a zygote is needed."""
    loaded = loaded_by("import preload_launcher.cli, preload_launcher.cli_run")
    assert loaded == {"cli", "cli_run", "daemon_files", "files", "identity", "mirroring",
                      "result", "rundir", "settings"}, loaded


def test_no_import_cycles_and_no_function_level_package_imports():
    graph = {}
    for name, source in sources().items():
        imports = package_imports(ast.parse(source))
        assert not [m for m, nested in imports if nested], f"{name} imports inside a function"
        graph[name] = {m for m, _ in imports}

    def reaches(start, goal, seen):
        for nxt in graph.get(start, ()):
            if nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt})):
                return True
        return False

    cycles = [name for name in graph if reaches(name, name, {name})]
    assert not cycles, cycles


def test_one_fork_and_one_child_exit():
    src = sources()
    forks = {name: s.count("os.fork(") for name, s in src.items() if "os.fork(" in s}
    assert forks == {"runtime": 1}
    exits = {name: s.count("os._exit(") for name, s in src.items() if "os._exit(" in s}
    # mirroring: every forked process (runtime.exit_with), and a process standing for a
    # program (a stand-in, the CLI) ends as the program did; zygote: the zygote's own end.
    assert exits == {"zygote": 1, "mirroring": 1}, exits


def test_only_settings_reads_the_launchers_variables():
    launcher_variable = re.compile(r"(PRELOAD_LAUNCHER\w*|XDG_\w+)")
    offenders = []
    for name, source in sources().items():
        if name == "settings":
            continue
        for node in ast.walk(ast.parse(source)):
            reads_environ = (isinstance(node, ast.Call) and "environ" in ast.unparse(node.func)
                             or isinstance(node, ast.Subscript) and "environ" in ast.unparse(node.value)
                             or isinstance(node, ast.Compare) and "environ" in ast.unparse(node))
            if reads_environ and launcher_variable.search(ast.unparse(node)):
                if not (isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store)):
                    offenders.append(f"{name}: {ast.unparse(node)}")
    assert not offenders, offenders


def test_no_function_over_sixty_lines():
    long = [f"{name}.{node.name}: {node.end_lineno - node.lineno + 1}"
            for name, source in sources().items() for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > 60]
    assert not long, long


def test_no_module_over_four_hundred_lines():
    """A module one reader can hold in their head; a new responsibility gets a new module."""
    long = {name: source.count("\n") for name, source in sources().items()
            if source.count("\n") > 400}
    assert not long, long
