"""A package that does not import its settings module (huggingface_hub's constants, torch's
_dynamo): a program configures it through the environment before importing that module."""
import os  # noqa: F401  (a package that imports something, as such packages do)
