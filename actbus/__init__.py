"""actbus: a streaming activation bus for vLLM."""

__version__ = "0.1.0"
