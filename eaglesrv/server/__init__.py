"""The HTTP frontend: OpenAI's API and SGLang's native one, in front of an engine process
(reached through eaglesrv.engine.client; the engine loop and its messages live in
eaglesrv/engine/process.py and protocol.py). Nothing here imports torch.

Module map (data flows top to bottom):
    lifecycle.py        start-up, serving, SIGTERM drain, exit codes
    app.py              FastAPI app: routers, error envelopes, middleware
    middleware.py       API key (constant time), request-body size limit
    chat.py             POST /v1/chat/completions
    completions.py      POST /v1/completions
    native.py           POST /generate, GET /get_server_info, /get_model_info, POST /flush_cache
    service.py          GET /health, /metrics, /v1/models
    openai_protocol.py  request bodies (pydantic); responses are built where they are filled
    request_prep.py     prompts -> token ids, fields -> SamplingParams, every 400 check
    generation.py       one choice: engine outputs -> text deltas (stop strings, metrics); fan-out
    detokenizer.py      incremental detokenization, whole characters only
    stop_strings.py     stop strings with hold-back, so none leaks into a stream
    formatting.py       body parsing, ids, usage, logprobs shapes, SSE, disconnect watching
    state.py            ServerState: the one owner of shared state (phase, admission, tokenizer)
    metrics.py          Prometheus registry owned by the server
    errors.py           OpenAI's error envelope
    not_landed.py       flags accepted before their features land; the one place that says so
"""
