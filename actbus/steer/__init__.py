"""Steering: vectors added to the residual stream inside the compiled graph.

``config`` parses what users write (the engine's ``actbus.steer`` and a request's
``steer`` list), ``vectors`` holds named vectors and loads them from files and
checkpoints, ``graph`` is what the traced forward computes, ``worker`` fills the
per-token tables before each forward, ``frontend`` resolves a request's steering
into the form the worker trusts and ``live`` holds the vectors pushes replace. The
Python and HTTP APIs over a running engine are the engine's (``actbus.engine.api``,
``actbus.engine.routes``): they reach into vLLM.
"""
