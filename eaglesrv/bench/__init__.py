"""Offline benchmark helpers behind `python -m eaglesrv.bench_offline`.

timing: batch-1 decode rate of eaglesrv and of Hugging Face transformers, timed the same way.
workload: held-out ShareGPT requests, run with a fixed number in flight.
report: the machine's description, the Markdown table.
"""
