"""The comparison benchmark, `python -m eaglesrv.bench_compare`: one fresh server per
configuration (plain, EAGLE-3 trees, adaptive, any NAME=FLAGS, optionally from another
source tree), the same prompts at each concurrency, one table and plot. Each run is a
`bench.serving` run.

configs: ServerVariant (a named set of launch flags) and the ones the flags ask for.
launcher: ManagedServer, `python -m eaglesrv.launch` on a free port, stopped after.
run: every configuration at every concurrency, over one or several interleaved rounds.
report: the Markdown and JSON table, the ratios to plain, the throughput plot.
"""
