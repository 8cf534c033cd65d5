"""The serving engine: scheduling, KV blocks, sampling, the step loop."""
