"""The engine: model, weights, KV pools, step runners, EAGLE-3, the Engine API and its process.

    llm_engine.py     Engine: step() = schedule, run, update; generate(); add/abort from any thread
    builder.py        assembles model, KV pools, attention backend, runner, adaptive policy, scheduler
    placement.py      device, dtype and KV pool size, decided once at start-up
    step_runner.py    StepRunner: the interface Engine.step runs (and the scheduler asks)
    plain_runner.py   PlainRunner: one forward, sample
    eagle3/           Eagle3Runner: draft trees, verification, draft extend; the head; its records
    adaptive/         the per-step choice of how much to speculate (cost model, acceptance, policy)
    tree_shape.py     TreeShape: below eagle3/ and adaptive/, so neither imports the other for it
    model/, loader/   the Llama-family model and resolving/loading weights
    kv_cache.py       KVPool tensors, indexed by the scheduler's page ids
    sampler.py        penalties, temperature/top-k/top-p/min-p, seeded draws, logprobs
    process.py        the engine loop in its own process; protocol.py its messages;
    client.py         the API process's handle on it (asyncio streams, stats)
"""
