"""The Inspect AI provider ``actbus/<model>``, found through the ``inspect_ai`` entry point.

Loading this module registers the name; the model class (``actbus.inspect_model``) is
imported only when an evaluation asks for it.
"""

from __future__ import annotations

from inspect_ai.model import ModelAPI, modelapi


@modelapi(name="actbus")
def actbus() -> type[ModelAPI]:
    from actbus.inspect_model import ActbusAPI

    return ActbusAPI
