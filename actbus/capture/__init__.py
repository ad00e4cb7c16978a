"""The capture path: in-graph taps, per-step harvesting, and vLLM runner adapters."""
