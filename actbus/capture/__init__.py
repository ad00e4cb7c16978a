"""Capture: in-graph taps, the per-step harvest into messages, returned rows.

What meets vLLM (runner adapters, the step loop, the front end) is in ``actbus.engine``.
"""
