"""The error every check of user input raises: the bottom of actbus's import stack."""

from __future__ import annotations


class ConfigError(ValueError):
    """Bad actbus configuration; the message names the field and the fix."""


class VllmVersionError(RuntimeError):
    """This vLLM's internals differ from what actbus reads; the message names the vLLM
    version and what changed. Raised instead of capturing rows that could be wrong."""
