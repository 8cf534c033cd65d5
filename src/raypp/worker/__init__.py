"""The stage side: one process per (pp, tp) rank, run as a Ray actor."""
