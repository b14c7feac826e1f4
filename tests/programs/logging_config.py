"""Configures logging as programs do before importing their libraries, then uses a library's
loggers: what a fresh interpreter prints and reports."""
import json
import logging
import logging.config
import os
import sys


def process_age_s() -> float:
    """Seconds since this process began (for a forked one: since its fork)."""
    with open("/proc/self/stat") as f:
        started = int(f.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
    with open("/proc/uptime") as f:
        return float(f.read().split()[0]) - started

before = sorted(logging.Logger.manager.loggerDict)
mine = logging.getLogger("makes_loggers.mine")  # the program's own, under the library's name
logging.config.dictConfig({
    "version": 1,  # disable_existing_loggers: True, dictConfig's default (and fileConfig's)
    "handlers": {"out": {"class": "logging.StreamHandler", "stream": "ext://sys.stdout",
                         "formatter": "plain"}},
    "formatters": {"plain": {"format": "%(name)s %(levelname)s %(message)s"}},
    "root": {"level": "INFO", "handlers": ["out"]},
})
import makes_loggers  # noqa: E402

makes_loggers.log.warning("library says hello")
makes_loggers.child.warning("child says hello")
mine.warning("program says hello")
record = logging.LogRecord("x", logging.INFO, __file__, 1, "m", None, None)
sys.stdout.flush()
print(json.dumps({
    "before": before,
    "after": sorted(logging.Logger.manager.loggerDict),
    "disabled": [makes_loggers.log.disabled, makes_loggers.child.disabled],
    "same": [logging.getLogger("makes_loggers") is makes_loggers.log,
             mine.parent is makes_loggers.log, makes_loggers.child.parent is makes_loggers.log],
    # relativeCreated counts from logging's import, within this process's life
    "relative_created_in_process": record.relativeCreated / 1000 <= process_age_s() + 0.05,
}))
