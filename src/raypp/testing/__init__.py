"""Tiny Hugging Face–format checkpoints for tests and the demo, and test helpers."""

import time
from pathlib import Path
from typing import Any

DEMO_MODEL_DIR = Path(__file__).parent / "demo_model"


def wait_suspended(executor: Any, timeout: float = 30.0) -> bool:
    """Wait until an idle compiled-graph executor has suspended its graph (no step and
    no compiled-graph channel left); False if it did not within ``timeout``."""
    deadline = time.monotonic() + timeout
    while not executor.suspended and time.monotonic() < deadline:
        time.sleep(0.1)
    return executor.suspended
