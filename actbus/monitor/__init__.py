"""Monitors: probe directions and SAE features scored inside the compiled graph.

``config`` parses the engine's ``actbus.monitor`` entry and a request's ``monitor``
keys, ``weights`` loads a monitor's weights from raw values and actbus checkpoints,
``graph`` is what the traced forward computes (scores into persistent buffers),
``frontend`` resolves a request's monitors, ``worker`` turns each step's scores into
bus messages and ``reader`` is the subscriber side.
"""
