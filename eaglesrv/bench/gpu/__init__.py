"""The GPU benchmark, `python -m eaglesrv.bench_gpu`: the figures issue 40 sets targets for,
on the Llama-3.1-8B shape with dummy bf16 weights, side by side in one run.

measure: the weight-streaming floor, batch-1 step timing, fixed random-id workloads.
report: the one table (with gpu_check.sh's checks above the figures).
"""
