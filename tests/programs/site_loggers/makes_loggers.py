"""A module that makes loggers at import, as torch and transformers do."""
import logging

log = logging.getLogger("makes_loggers")
child = logging.getLogger("makes_loggers.child")
odd = logging.getLogger("OddlyNamedLogger")  # torch's LoggingTensor: not the module's name
