"""The OpenAI-compatible HTTP server.

- :mod:`.app`: the ASGI app (``build_app``, ``ServerConfig``): routes, API key,
  body-size limit, status counting, error handlers.
- :mod:`.serving`: the completions, chat and models handlers (admission, unary runs).
- :mod:`.streaming`: SSE framing, per-choice deltas, merging engine streams,
  disconnects.
- :mod:`.protocol`: the request and response shapes; :mod:`.logprobs`: logprob
  formats; :mod:`.errors`: error bodies and how engine failures map to them.
- :mod:`.server`: the ``raypp serve`` command.

The server's Prometheus metrics are :mod:`raypp.entrypoints.metrics`.
"""
