"""What ``raypp bench`` runs for users: hop, throughput, latency, make-model, serve (see
:mod:`raypp.bench.cli`). Nothing else in raypp imports it but the CLI; the lab scripts
live in the repository's ``benchmarks/``."""
