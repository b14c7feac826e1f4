"""Whether a test program runs in a zygote's fork rather than a fresh interpreter, asked at
the program's start, before its own imports.

A step's module table hides the zygote's preloaded modules from ``sys.modules`` by design, so
a preloaded name there says nothing; the native libraries their imports loaded stay mapped in
the forked process, where a fresh interpreter maps them only once the program imports what
loads them."""

__all__ = ["maps"]


def maps(library: str) -> bool:
    """Whether a file whose name starts with ``library`` (``"libtorch"``) is mapped now."""
    with open("/proc/self/maps") as f:
        return any(line.rpartition("/")[2].startswith(library) for line in f)
