"""The offline benchmark, `python -m eaglesrv.bench_offline`: the engine and Hugging Face
transformers on the same weights in one process, batch-1 decode side by side, then
continuous batching over held-out ShareGPT prompts.

timing: batch-1 decode rate of eaglesrv and of transformers, timed the same way.
workload: held-out ShareGPT requests, run with a fixed number in flight.
report: the Markdown table.
"""
