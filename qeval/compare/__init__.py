"""Comparison math: per-token kernels, chunk-by-chunk metrics over two stores, statistics, and the
one metric registry every output iterates."""
