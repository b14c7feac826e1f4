"""Two steps with something changed between them, after a zygote may have learned what the
first imported (tests/test_learned_fidelity.py runs each case plainly and through the launcher,
and compares what the steps printed). ``step(args, env)`` runs one command and returns
(returncode, output); ``settle()`` waits until the zygote took in what the first step taught it
(a no-op when no zygote serves)."""
import os
import re
import sys
import time

PY = sys.executable
CASES = ("edited", "edited_dependency", "env", "hf_offline", "pytest_plugins")

PYTEST_INI = "[pytest]\nfilterwarnings =\n    error\n"
PYTEST_SUITE = ("def test_one():\n    assert 1 + 1 == 2\n\n\ndef test_two():\n    assert 'a' in 'ab'\n"
                "\n\ndef test_three():\n    assert [1] == [1]\n")


def prepare(case: str, root: str) -> tuple[list[str], dict, dict]:
    """The files ``case`` needs under ``root``: (command, first env additions, second's)."""
    site = os.path.join(root, "site")
    if case == "edited":
        _write(os.path.join(site, "learned_mod.py"), "X = 'old'\n")
        return [PY, "-c", "import learned_mod; print(learned_mod.X)"], {}, {}
    if case == "edited_dependency":  # learned as the module it is imported by
        _write(os.path.join(site, "learned_user.py"), "from learned_dep import X\n")
        _write(os.path.join(site, "learned_dep.py"), "X = 'old'\n")
        return [PY, "-c", "import learned_user; print(learned_user.X)"], {}, {}
    if case == "env":
        _write(os.path.join(site, "env_mod.py"),
               "import os\nMODE = os.environ.get('LEARNED_CASE_MODE', 'default')\n")
        return [PY, "-c", "import env_mod; print(env_mod.MODE)"], {}, {"LEARNED_CASE_MODE": "x"}
    if case == "hf_offline":
        code = ("from huggingface_hub import constants\n"
                "print(constants.HF_HUB_OFFLINE, constants.HF_HUB_CACHE)")
        return [PY, "-c", code], {}, {"HF_HUB_OFFLINE": "1", "HF_HOME": os.path.join(root, "hf")}
    if case == "pytest_plugins":
        suite = os.path.join(root, "suite")
        _write(os.path.join(suite, "pytest.ini"), PYTEST_INI)
        _write(os.path.join(suite, "test_suite.py"), PYTEST_SUITE)
        return [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", suite], {}, {}
    raise ValueError(case)


def change(case: str, root: str) -> None:
    """What happens between the two steps besides their environments."""
    if case in ("edited", "edited_dependency"):
        path = os.path.join(root, "site", "learned_mod.py" if case == "edited" else "learned_dep.py")
        _write(path, "X = 'new'\n")
        later = os.stat(path).st_mtime + 1  # the same mtime is never the test's question
        os.utime(path, (later, later))


def scenario(case: str, root: str, env: dict, step, settle) -> list:
    """Run ``case``'s two steps; returns what each printed, normalised."""
    args, first, second = prepare(case, root)
    site = os.path.join(root, "site")
    if site not in env.get("PYTHONPATH", "").split(os.pathsep):
        env = dict(env, PYTHONPATH=os.pathsep.join([site, env.get("PYTHONPATH", "")]))
    seen = [step(args, dict(env, **first))]
    settle()
    change(case, root)
    seen.append(step(args, dict(env, **second)))
    return [(code, normalise(out)) for code, out in seen]


def normalise(output: str) -> str:
    """pytest's durations differ from run to run, and a nested pytest under the switch adds the
    launcher's summary of its session (what it served); nothing else should differ."""
    kept, in_summary = [], False
    for line in output.splitlines(keepends=True):
        if re.fullmatch(r"-+ preload_launcher\b.* -+\n", line):
            in_summary = True
        elif in_summary and re.match(r"[-=]+ |\d+ (passed|failed)", line):
            in_summary = False
        if not in_summary:
            kept.append(line)
    return re.sub(r" in [0-9.]+s", " in Ts", "".join(kept))


def wait_settled(ask_status, timeout: float = 120.0) -> None:
    """Until a zygote has reaped every step and finished learning from them: ``ask_status()``
    returns its status."""
    deadline = time.monotonic() + timeout
    while True:
        status = ask_status()
        if status["running"] == 0 and not status["learn_pending"]:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"the zygote did not settle: {status}")
        time.sleep(0.1)


def _write(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
