"""One snapshot of the launcher's variables, one boolean rule, errors that name their source."""

import pytest

from preload_launcher.settings import (DEFAULT_MODULES, Settings, SettingsError, ZygoteConfig,
                                       parse_bool, preload_modules)


@pytest.mark.parametrize("word", ["1", "true", "TRUE", "yes", "On", " on "])
def test_true_words(word):
    assert parse_bool(word, "here") is True


@pytest.mark.parametrize("word", ["0", "false", "False", "no", "OFF", ""])
def test_false_words(word):
    assert parse_bool(word, "here") is False


@pytest.mark.parametrize("key", ["PRELOAD_LAUNCHER", "PRELOAD_LAUNCHER_SPAWN",
                                 "PRELOAD_LAUNCHER_LEARN", "PRELOAD_LAUNCHER_PREWARM"])
def test_every_flag_follows_the_one_rule(key):
    field = {"PRELOAD_LAUNCHER": "enabled", "PRELOAD_LAUNCHER_SPAWN": "spawn",
             "PRELOAD_LAUNCHER_LEARN": "learn", "PRELOAD_LAUNCHER_PREWARM": "prewarm"}[key]
    assert getattr(Settings.from_env({key: "false"}), field) is False
    assert getattr(Settings.from_env({key: "yes"}), field) is True
    with pytest.raises(ValueError, match=f"'maybe' from {key} environment variable"):
        Settings.from_env({key: "maybe"})


def test_defaults_from_an_empty_environment():
    s = Settings.from_env({"HOME": "/home/u"})
    assert (s.enabled, s.toggle, s.spawn, s.learn, s.prewarm) == (True, None, True, True, None)
    assert (s.learn_budget_s, s.max_ranks, s.probe, s.prewarm_cuda) == (60.0, 1024, "libcuda", "context")
    assert s.cache_dir == "/home/u/.cache/preload_launcher"
    assert s.runtime_base == "/tmp"


def test_directories_follow_xdg_and_the_explicit_variable():
    assert Settings.from_env({"XDG_CACHE_HOME": "/c"}).cache_dir == "/c/preload_launcher"
    assert Settings.from_env({"XDG_CACHE_HOME": "/c", "PRELOAD_LAUNCHER_CACHE_DIR": "/d"}).cache_dir == "/d"
    assert Settings.from_env({"XDG_RUNTIME_DIR": "/run/user/7"}).runtime_base == "/run/user/7"


@pytest.mark.parametrize("key, value, message", [
    ("PRELOAD_LAUNCHER_LEARN_BUDGET_S", "soon", "Invalid float 'soon' from PRELOAD_LAUNCHER_LEARN_BUDGET_S"),
    ("PRELOAD_LAUNCHER_LEARN_BUDGET_S", "-1", "PRELOAD_LAUNCHER_LEARN_BUDGET_S environment variable must be at least 0"),
    ("PRELOAD_LAUNCHER_MAX_RANKS", "0", "PRELOAD_LAUNCHER_MAX_RANKS environment variable must be at least 1"),
    ("PRELOAD_LAUNCHER_PREWARM_RANKS", "two", "Invalid int 'two'"),
    ("PRELOAD_LAUNCHER_PREWARM_CUDA", "all", "one of: context, kernels, 0"),
    ("PRELOAD_LAUNCHER_PROBE", "nvml", "one of: libcuda, fake"),
    ("PRELOAD_LAUNCHER_MODULES", "torch,9lives", "Invalid module name '9lives' from PRELOAD_LAUNCHER_MODULES"),
])
def test_bad_values_say_where_they_came_from(key, value, message):
    with pytest.raises(ValueError, match=message):
        Settings.from_env({key: value})


def test_preload_list_precedence_explicit_then_env_then_ini_then_default():
    env = {"PRELOAD_LAUNCHER_MODULES": "json, logging"}
    assert preload_modules("a.b", "c", env) == ("a.b",)
    assert preload_modules(None, "c", env) == ("json", "logging")
    assert preload_modules(None, "c,d", {}) == ("c", "d")
    assert preload_modules(None, None, {}) == DEFAULT_MODULES
    with pytest.raises(ValueError, match="from --preload"):
        preload_modules("torch,,x-y", None, {})
    with pytest.raises(ValueError, match="from preload_launcher_modules ini option"):
        preload_modules(None, "x-y", {})


def test_the_zygote_config_survives_its_trip_on_the_command_line():
    config = ZygoteConfig(modules=["torch"], listen_fd=3, ready_fd=4, socket_path="/s.sock",
                          cache_dir="/c", project="/p", alive_fd=5, prewarm=True, prewarm_ranks=2)
    assert ZygoteConfig.from_json(config.to_json()) == config


def test_preload_launcher_suite_is_on_and_suite_wide():
    wanted = Settings.from_env({"PRELOAD_LAUNCHER": "Suite"})
    assert (wanted.enabled, wanted.toggle, wanted.suite_wide) == (True, True, True)
    assert Settings.from_env({"PRELOAD_LAUNCHER": "1"}).suite_wide is None  # the plugin decides
    assert Settings.from_env({"PRELOAD_LAUNCHER": "0"}).suite_wide is False
    with pytest.raises(SettingsError, match="or suite"):
        Settings.from_env({"PRELOAD_LAUNCHER": "everywhere"})
