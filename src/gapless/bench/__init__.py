"""Benchmark client for streaming completion servers: seeded workloads, timelines, metrics
(TTFT, TPOT, ITL, stalls during prefills, goodput), tables and plots."""
