"""A package whose own name for a function is also a submodule's name."""


def sub():
    return "the package's function"
