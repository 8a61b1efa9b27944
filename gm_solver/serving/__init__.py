"""graphmax where LLMs are served: what a serving engine's plug-in needs, engine by engine.

- :mod:`gm_solver.serving.requests`: engine-neutral. A request's ``{"graphmax": {...}}`` arguments checked in one line
  (:func:`~gm_solver.serving.requests.parse`), the graphs a server may serve (an allow-list of names, never a path),
  each loaded once and shared, and one step over the rows of many requests (:class:`~gm_solver.serving.requests.Rows`).
- :mod:`gm_solver.serving.vllm`: the vLLM plug-in, ``gm_solver.serving.vllm:GraphmaxLogitsProcessor`` (imports vLLM).
"""
