"""Mapping vLLM's internal request ids back to the ids callers gave.

vLLM appends ``-`` and 8 random hex characters to every caller-supplied id to keep
internal ids unique (unless VLLM_DISABLE_REQUEST_ID_RANDOMIZATION is set). Only the
worker sees internal ids, so the capture path undoes that here. Children of an
``n > 1`` request are named ``{index}_{parent internal id}`` by vLLM and keep that
prefix here: the worker cannot tell them from a caller id that starts with digits
and an underscore.
"""

from __future__ import annotations

import os
import re

_SUFFIX = re.compile(r"-[0-9a-f]{8}$")


def caller_request_id(internal_id: str) -> str:
    """The id the caller gave for an internal request id."""
    if os.environ.get("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", "0") not in ("", "0"):
        return internal_id
    return _SUFFIX.sub("", internal_id)
