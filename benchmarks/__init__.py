"""Reproducible performance tables and builds (SpecEdge-style benchmarks)."""
