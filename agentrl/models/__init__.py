"""Tiny, locally built models and tokenizers for tests, benchmarks and the CPU demo (no model hub)."""
