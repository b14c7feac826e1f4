"""Which reads let a default stand for an unset variable (``envreads.read_default``): only
reads that all took the same string default while the variable stayed unset. Each test uses
variables of its own: what was recorded stays recorded for the process."""
import os
import uuid

import pytest

from preload_launcher.zygote import envreads


@pytest.fixture
def key():
    name = f"ENVREADS_{uuid.uuid4().hex.upper()}"
    yield name
    os.environ.pop(name, None)


def reads(*steps):
    with envreads.recording_env_reads():
        for step in steps:
            step()


def test_reads_with_one_default_give_it(key):
    reads(lambda: os.getenv(key, "1"), lambda: os.environ.get(key, "1"))
    assert envreads.read_default(key) == "1"
    assert envreads.same_to_readers(key, None, "1") and not envreads.same_to_readers(key, None, "0")


@pytest.mark.parametrize("teller", [
    lambda key: key in os.environ,             # tells unset from set
    lambda key: os.environ.get(key),           # None: tells unset from any value
    lambda key: os.environ.get(key, 1),        # not a string: no value equals it
    lambda key: os.environ.get(key, "0"),      # another default
    lambda key: os.environ.get(key, None) is None,
    lambda key: os.environ[key] if key in os.environ else None,
])
def test_a_read_that_can_tell_gives_no_default(key, teller):
    reads(lambda: os.getenv(key, "1"), lambda: teller(key))
    assert envreads.read_default(key) is None


@pytest.mark.parametrize("write", [
    lambda key: os.environ.__setitem__(key, "0"),
    lambda key: os.environ.setdefault(key, "1"),
    lambda key: os.environ.update({key: "1"}),
])
def test_a_variable_the_imports_set_after_reading_it_gives_no_default(key, write):
    """A fresh interpreter that holds the default ends with what the import set; a step
    handed the module ends with its own value."""
    reads(lambda: os.getenv(key, "1"), lambda: write(key))
    assert envreads.read_default(key) is None


def test_a_variable_read_while_set_then_deleted_gives_no_default(key):
    """A read that found it set (cached by a module) could differ from what the default gives."""
    os.environ[key] = "1"
    reads(lambda: key in os.environ, lambda: os.environ.__delitem__(key),
          lambda: os.getenv(key, "1"))
    assert envreads.read_default(key) is None


def test_a_variable_native_code_reads_gives_no_default():
    reads(lambda: os.getenv("TORCH_DISTRIBUTED_DEBUG", "OFF"), lambda: os.getenv("OMP_PLACES", "x"))
    assert envreads.read_default("TORCH_DISTRIBUTED_DEBUG") is None
    assert envreads.read_default("OMP_PLACES") is None
