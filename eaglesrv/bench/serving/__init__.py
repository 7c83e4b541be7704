"""The serving benchmark, `python -m eaglesrv.bench_serving`: SGLang's bench_serving load
generator (its flags, its report) against a running eaglesrv, SGLang or vLLM server.

dataset: the requests, ShareGPT prompts or random-length ones, sampled as SGLang does.
shared_prefix: SGLang's generated-shared-prefix requests (groups sharing a long system prompt).
multiturn: ShareGPT conversations replayed turn by turn, each turn carrying the answers so far.
tokenizer: the served model's tokenizer, for counting tokens.
client: one request per backend API, timed (TTFT, inter-token latencies) into a RequestRecord.
run: one run: warm up, send every request at the set rate and concurrency, measure.
metrics: a run's metrics and the report SGLang prints, and a reader for it.
"""
