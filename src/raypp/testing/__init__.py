"""Tiny Hugging Face–format checkpoints for tests and the demo."""

from pathlib import Path

DEMO_MODEL_DIR = Path(__file__).parent / "demo_model"
