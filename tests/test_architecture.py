"""The package's shape: where each module lives, who imports whom, what importing it loads,
where the fork and the exit are written, and who reads the launcher's environment variables.

The folders are the pipeline's stages: ``caller/`` (the process that asks for a step),
``zygote/`` (the preloaded interpreter that forks it), ``step/`` (the forked step) and
``launchers/`` (torchrun and accelerate, served in the step); the front doors (``cli``,
``pytest_plugin``, the package's public names) sit on top, their parts in ``front/``; the modules
at the top besides them are shared by the stages."""

import ast
import os
import re
import subprocess
import sys

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "preload_launcher")
FRONT_DOORS = {"__init__", "cli", "pytest_plugin"}
FORKED = {"zygote", "step", "launchers"}  # what runs in the zygote and the processes it forks
# Who may import whom, by stage ("shared": a module at the top that is not a front door).
MAY_IMPORT = {
    "shared": {"shared"},
    "caller": {"shared", "caller"},  # the caller's process never loads the forked side
    **{stage: {"shared"} | FORKED for stage in FORKED},  # never the caller's side
    "front": {"shared", "caller", "front"} | FORKED,
}


def sources() -> dict[str, str]:
    """Every module by its dotted name under the package ("caller.client", "protocol")."""
    found = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                dotted = os.path.relpath(path, PACKAGE)[:-3].replace(os.sep, ".")
                with open(path, encoding="utf-8") as f:
                    found[dotted] = f.read()
    return dict(sorted(found.items()))


def stage_of(module: str) -> str:
    """Its folder (a package's own name counts as its folder), else a front door or shared."""
    folder, dot, _ = module.partition(".")
    if dot or os.path.isdir(os.path.join(PACKAGE, folder)):
        return folder
    return "front" if module in FRONT_DOORS else "shared"


def package_imports(module: str, tree: ast.AST, modules: set[str]) -> list[tuple[str, bool]]:
    """(imported package module, imported inside a function) for every relative import in
    ``module``; a package stands as its ``__init__``."""
    package = module.split(".")[:-1]  # an __init__'s package is its own folder
    found = []

    def resolve(node: ast.ImportFrom) -> list[str]:
        base = package[:len(package) - node.level + 1]
        target = ".".join([*base, *(node.module.split(".") if node.module else [])])
        if target in modules:
            return [target]
        named = [f"{target}.{a.name}".lstrip(".") for a in node.names]  # modules of a package
        return [n for n in named if n in modules] or [f"{target}.__init__".lstrip(".")]

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.ImportFrom) and child.level:
                found.extend((n, in_function) for n in resolve(child))
            visit(child, nested)

    visit(tree, False)
    return found


def import_graph() -> dict[str, set[str]]:
    graph, src = {}, sources()
    for name, source in src.items():
        imports = package_imports(name, ast.parse(source), set(src))
        assert not [m for m, nested in imports if nested], f"{name} imports inside a function"
        graph[name] = {m for m, _ in imports}
    return graph


def loaded_by(code: str) -> set[str]:
    """The package's modules that ``code`` loads in a fresh interpreter."""
    out = subprocess.run(
        [sys.executable, "-c", f"import sys; {code}; "
         "print(' '.join(m for m in sys.modules if m.startswith('preload_launcher.')))"],
        capture_output=True, text=True, check=True).stdout.split()
    return {m.split(".", 1)[1] for m in out}


def test_each_module_lives_in_a_stage_folder_and_shared_modules_are_shared():
    """A folder is a stage with its own import rule; a module at the top that only one stage
    imports belongs in that stage's folder."""
    graph = import_graph()
    folders = {m.partition(".")[0] for m in graph if "." in m}
    assert folders == set(MAY_IMPORT) - {"shared"}, folders
    importers = {}
    for importer, imported in graph.items():
        for module in imported:
            importers.setdefault(module, set()).add(stage_of(importer))
    lonely = {m: stages for m, stages in importers.items()
              if stage_of(m) == "shared" and len(stages) < 2}
    unused = [m for m in graph if stage_of(m) == "shared" and m not in importers]
    assert not lonely and not unused, (lonely, unused)


def test_imports_between_stages_go_only_the_allowed_ways():
    """The shared modules import no stage; the caller's process never loads the forked side
    (``import preload_launcher`` stays light, and no zygote code runs in a caller); the forked
    side never reaches back into the caller or the front doors; only the front doors import
    ``front/``."""
    wrong = [f"{importer} -> {module}" for importer, imported in import_graph().items()
             for module in imported
             if stage_of(module) not in MAY_IMPORT[stage_of(importer)]]
    assert not wrong, wrong


def test_importing_the_package_loads_only_the_callers_side():
    loaded = loaded_by("import preload_launcher; preload_launcher.run")
    assert "caller.client" in loaded, loaded
    assert not {m for m in loaded if stage_of(m) in FORKED | {"front"}}, loaded


def test_a_run_without_a_daemon_loads_neither_the_client_nor_the_zygote_side():
    """The console script's import path and `run`'s own, before it knows a zygote is needed."""
    loaded = loaded_by("import preload_launcher.cli, preload_launcher.front.cli_run")
    assert loaded == {"cli", "front", "front.cli_run", "front.daemon_files", "files", "identity",
                      "mirroring", "result", "rundir", "settings"}, loaded


def test_no_import_cycles_and_no_function_level_package_imports():
    graph = import_graph()

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
    assert forks == {"step.runtime": 1}
    exits = {name: s.count("os._exit(") for name, s in src.items() if "os._exit(" in s}
    # mirroring: every forked process (runtime.exit_with), and a process standing for a
    # program (a stand-in, the CLI) ends as the program did; zygote.server: the zygote's own end.
    assert exits == {"zygote.server": 1, "mirroring": 1}, exits


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
