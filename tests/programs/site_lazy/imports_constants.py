"""Another preloaded module that imports lazy_pkg's settings (in the zygote, not in a step)."""
import lazy_pkg.constants  # noqa: F401
