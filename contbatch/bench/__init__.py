"""Benchmarks: offline throughput against transformers' engines, prefix-caching and GRPO workloads, online serving."""
