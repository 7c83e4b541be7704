"""Helpers of eaglesrv's three benchmarks; their command lines are the top-level modules.

offline: `python -m eaglesrv.bench_offline`, the engine against transformers in one process.
serving: `python -m eaglesrv.bench_serving`, an SGLang-compatible load generator against a running server.
compare: `python -m eaglesrv.bench_compare`, one server per configuration, the same prompts sent to each.
machine: the machine a run was on (offline and compare print it).

compare drives serving's load generator; serving and offline import no other benchmark.
"""
