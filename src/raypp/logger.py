"""raypp's loggers print to stderr at ``RAYPP_LOG_LEVEL`` unless the app configured them."""

from __future__ import annotations

import logging

from raypp import envs

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure() -> None:
    """Give the ``raypp`` logger a stderr handler once (no-op if it already has one)."""
    logger = logging.getLogger("raypp")
    if logger.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(_FORMAT))
    logger.addHandler(handler)
    logger.setLevel((envs.RAYPP_LOG_LEVEL or "INFO").upper())
    logger.propagate = False
