"""Deferral under every way a guarded import is written: each statement form inside each guard,
a plugin that raises past ImportError, a learned module that guards the deferred package and a
step that probes with find_spec first. A step's registries and names equal a fresh interpreter's."""
import os
import textwrap

import pytest

from preload_launcher import Launcher
from preload_launcher.front.reporting import format_deferred

from conftest import PY, plain

FORMS = {  # statement, with {m} the plugin module
    "star": "from .{m} import *",
    "rel": "from . import {m}",
    "abs": "from fakeopt.plugins import {m}",
    "dotted": "import fakeopt.plugins.{m}",
    "alias": "import fakeopt.plugins.{m} as {m}_alias",
    "call": "{m}_mod = importlib.import_module('fakeopt.plugins.{m}')",
    "dunder": "__import__('fakeopt.plugins.{m}')",
}
GUARDS = {  # a guard around one statement
    "try": "try:\n    {stmt}\nexcept ImportError:\n    pass\n",
    "suppress": "with contextlib.suppress(ImportError):\n    {stmt}\n",
    "plugin": "with import_plugin('{m}'):\n    {stmt}\n",
}
PLUGIN = """
import fakegeo
from fakeopt.registry import REGISTRY
REGISTRY['{m}'] = fakegeo.Linear.__name__
__all__ = ['X_{m}']
class X_{m}:
    pass
"""
RAISES = PLUGIN + "raise RuntimeError('{m}: no geo today')\n"

# modelopt's shape of import_plugin (modelopt/torch/utils/import_utils.py): a contextmanager
# that swallows ModuleNotFoundError quietly and any other Exception with a warning that names
# the ``with`` statement's file and line.
IMPORT_PLUGIN = """
import contextlib, sys

@contextlib.contextmanager
def import_plugin(name):
    try:
        yield
    except ModuleNotFoundError:
        pass
    except Exception as e:
        caller = sys._getframe(2)
        where = f'{caller.f_code.co_filename}:{caller.f_lineno}'
        print(f'plugin {name} failed: {e!r} at {where}')
"""


def plugin_init():
    lines = ["import contextlib, importlib", "from fakeopt.utils import import_plugin"]
    for form, stmt in FORMS.items():
        for guard, text in GUARDS.items():
            m = f"p_{form}_{guard}"
            lines.append(text.format(stmt=stmt.format(m=m), m=m))
    # A plugin that raises past ImportError: swallowed only by guards that catch it.
    lines.append(GUARDS["plugin"].format(stmt="from . import p_raises_plugin", m="p_raises_plugin"))
    lines.append("try:\n    from .p_raises_exc import *\nexcept Exception:\n    pass\n")
    return "\n".join(lines) + "\n"


def files(log):
    out = {
        "fakeopt/__init__.py": "from . import plugins\n",
        "fakeopt/registry.py": "REGISTRY = {'Linear': 'torch'}\n",
        "fakeopt/utils.py": IMPORT_PLUGIN,
        "fakeopt/plugins/__init__.py": plugin_init(),
        "fakegeo/__init__.py": "from .typing import Linear\n",
        "fakegeo/typing.py": f"""
            from preload_launcher.cuda import fake_cuinit
            open({str(log)!r}, 'a').write('fakegeo imported\\n')
            fake_cuinit()
            class Linear:
                pass
        """,
        # A module steps import (and the zygote learns) that guards the deferred package.
        "guarded_user.py": """
            try:
                import fakegeo
                HAVE_GEO = True
            except ImportError:
                HAVE_GEO = False
        """,
    }
    for form in FORMS:
        for guard in GUARDS:
            m = f"p_{form}_{guard}"
            out[f"fakeopt/plugins/{m}.py"] = PLUGIN.format(m=m)
    for m in ("p_raises_plugin", "p_raises_exc"):
        out[f"fakeopt/plugins/{m}.py"] = RAISES.format(m=m)
    return out


OBSERVE = textwrap.dedent("""
    import sys, fakeopt.plugins as p
    from fakeopt.registry import REGISTRY
    print(sorted(REGISTRY))
    print(sorted(n for n in vars(p) if not n.startswith('__')))
    print({n: getattr(v, '__name__', None) for n, v in sorted(vars(p).items())
           if n.endswith(('_mod', '_alias')) or n == 'fakeopt'})
    print('fakegeo' in sys.modules)
""")


@pytest.fixture
def site(tmp_path):
    root = tmp_path / "site"
    log = tmp_path / "imports.log"
    for name, text in files(log).items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    dist = root / "fakeopt-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fakeopt\nVersion: 1.0\n")
    project = tmp_path / "project"
    project.mkdir()
    env = dict(os.environ, PYTHONPATH=str(root), PRELOAD_LAUNCHER_PROBE="fake",
               PRELOAD_LAUNCHER_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("PRELOAD_LAUNCHER_LEARN", None)
    return env, project


def run_both(launcher, code, env, cwd):
    ours = launcher.run([PY, "-c", code], env=env, cwd=str(cwd))
    fresh = plain([PY, "-c", code], env=env, cwd=str(cwd))
    return ours, fresh


@pytest.mark.parametrize("mode", ["lazy", "eager"])
def test_every_guard_form_replays_as_a_fresh_interpreter_imports(site, mode):
    env, project = site
    env = dict(env, PRELOAD_LAUNCHER_DEFERRED=mode)
    launcher = Launcher(["fakeopt"], project=str(project))
    try:
        report = launcher.zygote_for(env).status["preload"]
        assert report["loaded"] == ["fakeopt"] and "fakegeo" in report["deferred"]
        # Every plugin was cut off (the two that raise included) and will be replayed.
        cut = {c["module"].rpartition(".")[2] for c in report["deferred"]["fakegeo"]["cut"]}
        assert cut == {f"p_{f}_{g}" for f in FORMS for g in GUARDS} | {"p_raises_plugin",
                                                                        "p_raises_exc"}
        code = ("import fakegeo\n" if mode == "lazy" else "") + OBSERVE
        ours, fresh = run_both(launcher, code, env, project)
        assert ours.via == "zygote"
        assert ours.returncode == fresh.returncode == 0, ours.stdout
        assert ours.stdout == fresh.stdout
        assert "plugin p_raises_plugin failed: RuntimeError" in ours.stdout
        assert "fakeopt/plugins/__init__.py:" in ours.stdout
        assert "'p_star_try'" in ours.stdout and "X_p_star_plugin" in ours.stdout
    finally:
        launcher.close()


def test_doctor_names_the_plugin_in_the_chain_and_every_replayed_import(site):
    env, project = site
    launcher = Launcher(["fakeopt"], project=str(project))
    try:
        deferred = launcher.zygote_for(env).status["preload"]["deferred"]
        chain = deferred["fakegeo"]["chain"]
        assert chain[:2] == ["fakeopt", "fakeopt.plugins"]
        assert chain[2].startswith("fakeopt.plugins.p_") and chain[3].startswith("fakegeo")
        lines = format_deferred(deferred)
        replayed = [line for line in lines if "replayed in steps" in line]
        assert len(replayed) == len(FORMS) * len(GUARDS) + 2
        assert any("fakeopt.plugins.p_rel_suppress" in line for line in replayed)
    finally:
        launcher.close()


def test_find_spec_before_the_import_does_not_use_up_the_replay(site):
    env, project = site
    code = ("import importlib.util\nassert importlib.util.find_spec('fakegeo') is not None\n"
            "import fakegeo\n" + OBSERVE)
    launcher = Launcher(["fakeopt"], project=str(project))
    try:
        ours, fresh = run_both(launcher, code, env, project)
        assert ours.via == "zygote" and ours.returncode == 0, ours.stdout
        assert ours.stdout == fresh.stdout
        assert "'p_rel_try'" in ours.stdout
    finally:
        launcher.close()


def test_a_learned_module_that_guards_a_deferred_package_sees_it_as_fresh(site):
    env, project = site
    code = "import fakeopt, guarded_user, fakegeo\nprint(guarded_user.HAVE_GEO)\n"
    first = Launcher(["fakeopt"], project=str(project))
    try:  # this step teaches the next zygote guarded_user
        assert first.run([PY, "-c", code], env=env, cwd=str(project)).stdout.endswith("True\n")
    finally:
        first.close()
    launcher = Launcher(["fakeopt"], project=str(project))
    try:
        learned = launcher.zygote_for(env).status["preload"]["learned"]
        assert "guarded_user" in learned["guards_deferred"]
        ours, fresh = run_both(launcher, code, env, project)
        assert ours.via == "zygote"
        assert ours.stdout == fresh.stdout and ours.stdout.endswith("True\n")
    finally:
        launcher.close()


@pytest.mark.parametrize("mode", ["lazy", "eager"])
def test_a_deferred_namespace_package_and_an_empty_all_replay_as_fresh(tmp_path, mode):
    """megatron's shape (a namespace package) deferred; a plugin with ``__all__ = []``."""
    root = tmp_path / "site"
    for name, text in {
        "nsopt/__init__.py": "from . import plugins\n",
        "nsopt/registry.py": "REGISTRY = ['base']\n",
        "nsopt/plugins/__init__.py": "try:\n    from .geo import *\nexcept ImportError:\n    pass\n",
        "nsopt/plugins/geo.py": "import fakens.typing\nfrom nsopt.registry import REGISTRY\n"
                                "REGISTRY.append('geo')\n__all__ = []\nPUBLIC = 1\n",
        "fakens/typing.py": "from preload_launcher.cuda import fake_cuinit\nfake_cuinit()\n",
        "nsopt-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: nsopt\nVersion: 1.0\n",
    }.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    env = dict(os.environ, PYTHONPATH=str(root), PRELOAD_LAUNCHER_PROBE="fake",
               PRELOAD_LAUNCHER_CACHE_DIR=str(tmp_path / "cache"), PRELOAD_LAUNCHER_DEFERRED=mode)
    code = (("import fakens\n" if mode == "lazy" else "") +
            "import nsopt.plugins as p, fakens\nfrom nsopt.registry import REGISTRY\n"
            "print(REGISTRY, hasattr(p, 'PUBLIC'), fakens.__file__, type(fakens.__loader__).__name__)\n")
    launcher = Launcher(["nsopt"], project=str(tmp_path))
    try:
        assert "fakens" in launcher.zygote_for(env).status["preload"]["deferred"]
        ours, fresh = run_both(launcher, code, env, tmp_path)
        assert ours.via == "zygote"
        assert ours.stdout == fresh.stdout
        assert ours.stdout.startswith("['base', 'geo'] False None ")
        assert ours.stdout.endswith("NamespaceLoader\n")  # _NamespaceLoader on 3.10
    finally:
        launcher.close()
