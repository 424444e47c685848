"""Benchmarks of rosejax (and of HF transformers beside it); figures go in docs/performance-log.md."""
