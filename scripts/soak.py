"""A bounded soak test of a running eaglesrv server, on loopback only.

    python scripts/soak.py                         # starts a float32 server on a 4096-token KV pool
    python scripts/soak.py --base-url http://127.0.0.1:30000 --api-key KEY --num-requests 200

It sends `--num-requests` mixed requests at `--concurrency` in flight: chat and
completions, streamed or not, n of 1 or 2, with and without stop strings; a tenth are
streams the client cuts after their first chunk, and a twentieth are hostile (each must
get its 4xx). Every other request must finish with exactly the greedy output the same
request gets alone (measured first, one at a time), or be refused with 503 (overload).
Nothing may hang (`--request-timeout`). Afterwards the server must be idle with every KV
page free, or kept by the prefix cache for no request. Exit code 0 when all of that
holds; the summary says what did not.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from collections import Counter

import httpx

PROMPTS = ["The capital of France is", "List three colors:", "Write a haiku about rain.", "2 + 2 =",
           "Explain what a CPU does in one sentence.", "Name a large animal.", "Once upon a time",
           "The opposite of hot is", "Translate 'good morning' to French:", "What is the tallest mountain?"]
STOPS = [None, ["."], ["\n"], [",", "!"]]
HOSTILE = [  # (body or raw text, path): each must be answered 4xx
    ({"prompt": [10**9], "max_tokens": 4}, "/v1/completions"),
    ({"messages": [], "max_tokens": 4}, "/v1/chat/completions"),
    ({"prompt": "x", "stop": ["a"] * 500, "max_tokens": 4}, "/v1/completions"),
    ({"prompt": ["x"] * 2000, "max_tokens": 1}, "/v1/completions"),
    ('{"prompt": "x", "max_tokens": ' + "9" * 5000 + "}", "/v1/completions"),
    ("[" * 50_000, "/v1/chat/completions"),
]


def cases(max_tokens: int) -> list[tuple[str, dict]]:
    """Every (path, body) a normal request may be: each prompt on both endpoints, with a stop rule and an n."""
    rng = random.Random(0)
    found = []
    for i, prompt in enumerate(PROMPTS):
        stop, n = STOPS[i % len(STOPS)], 2 if rng.random() < 0.3 else 1
        common = {"max_tokens": max_tokens, "temperature": 0, "n": n, **({"stop": stop} if stop else {})}
        found.append(("/v1/completions", {"prompt": prompt, **common}))
        found.append(("/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}], **common}))
    return found


def texts(path: str, payload: dict) -> list[str]:
    """Each choice's text, in choice order."""
    choices = sorted(payload["choices"], key=lambda c: c["index"])
    return [c["text"] if path == "/v1/completions" else c["message"]["content"] for c in choices]


async def streamed_texts(http: httpx.AsyncClient, path: str, body: dict, cut: bool) -> tuple[int, list[str] | None]:
    parts: dict[int, str] = {}
    async with http.stream("POST", path, json={**body, "stream": True}) as response:
        if response.status_code != 200:
            await response.aread()
            return response.status_code, None
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:  # the engine stopped or stalled mid-stream
                return (503 if event["error"].get("code") == "service_unavailable" else 500), None
            for choice in event["choices"]:
                piece = choice.get("text") if path == "/v1/completions" else choice["delta"].get("content")
                parts[choice["index"]] = parts.get(choice["index"], "") + (piece or "")
            if cut:
                return 200, None  # leaving the block closes the stream mid-way
    return 200, [parts[i] for i in sorted(parts)]


async def one(http, rng: random.Random, case, expected, tally: Counter, problems: list, timeout: float) -> None:
    try:
        await asyncio.wait_for(_one(http, rng, case, expected, tally, problems), timeout)
    except asyncio.TimeoutError:
        problems.append(f"a request hung for {timeout} s")


async def _one(http, rng: random.Random, case, expected, tally: Counter, problems: list) -> None:
    kind = rng.random()
    if kind < 0.05:
        body, path = rng.choice(HOSTILE)
        response = await (http.post(path, content=body) if isinstance(body, str) else http.post(path, json=body))
        tally["hostile"] += 1
        if not 400 <= response.status_code < 500:
            problems.append(f"hostile {path} answered {response.status_code}")
        return
    path, body = case
    if kind < 0.15:
        status, _ = await streamed_texts(http, path, body, cut=True)
        tally["cut" if status == 200 else f"cut-{status}"] += 1
        return
    if kind < 0.55:
        status, got = await streamed_texts(http, path, body, cut=False)
    else:
        response = await http.post(path, json=body)
        status, got = response.status_code, texts(path, response.json()) if response.status_code == 200 else None
    tally["stream" if kind < 0.55 else "whole"] += 1
    if status == 503:
        tally["503"] += 1
    elif status != 200 or got != expected:
        problems.append(f"{path} {json.dumps(body)[:80]}: status {status}, {got!r} != {expected!r}")


async def soak(base_url: str, api_key: str | None, num_requests: int, concurrency: int, max_tokens: int,
               timeout: float, seed: int) -> tuple[Counter, list[str]]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=timeout + 10) as http:
        all_cases = cases(max_tokens)
        expected = [texts(path, (await http.post(path, json=body)).raise_for_status().json())
                    for path, body in all_cases]  # alone, one at a time
        rng, gate = random.Random(seed), asyncio.Semaphore(concurrency)
        tally, problems = Counter(), []

        async def limited(index: int) -> None:
            async with gate:
                pick = rng.randrange(len(all_cases))
                await one(http, random.Random(seed + index), all_cases[pick], expected[pick], tally, problems,
                          timeout)

        started = time.monotonic()
        await asyncio.gather(*(limited(i) for i in range(num_requests)))
        tally["seconds"] = round(time.monotonic() - started)
        problems += await idle_problems(http)
    return tally, problems


async def idle_problems(http: httpx.AsyncClient, within_s: float = 60.0) -> list[str]:
    """Nothing running or waiting and every KV page free or cached for nobody, within `within_s`."""
    deadline = time.monotonic() + within_s
    while True:
        state = (await http.get("/get_server_info")).json()["internal_states"][0]
        available = state["kv_pages_free"] + state.get("prefix_cache_evictable_pages", 0)
        seen = (state["num_running_reqs"], state["num_waiting_reqs"], available, state["kv_pages_total"])
        if seen[:2] == (0, 0) and seen[2] == seen[3]:
            return []
        if time.monotonic() > deadline:
            return [f"not idle afterwards: running {seen[0]}, waiting {seen[1]}, {seen[2]} of {seen[3]} pages "
                    "free or unused in the prefix cache"]
        await asyncio.sleep(0.5)


def start_server(port: int, max_total_tokens: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "eaglesrv.launch", "--host", "127.0.0.1", "--port", str(port), "--dtype",
               "float32", "--max-total-tokens", str(max_total_tokens), "--log-level", "warning"]
    server = subprocess.Popen(command)
    for _ in range(600):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        if server.poll() is not None:
            sys.exit(f"the server exited with {server.returncode}")
        time.sleep(0.5)
    server.terminate()
    sys.exit("the server did not become healthy")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", help="a running server on loopback (default: start one)")
    parser.add_argument("--api-key")
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--max-total-tokens", type=int, default=4096, help="KV pool of a started server")
    parser.add_argument("--request-timeout", type=float, default=300.0, help="seconds before a request counts as hung")
    parser.add_argument("--port", type=int, default=30077)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.num_requests > 20_000 or args.concurrency > 512:
        sys.exit("a soak is bounded: at most 20,000 requests and 512 in flight")
    base_url = args.base_url or f"http://127.0.0.1:{args.port}"
    if httpx.URL(base_url).host not in ("127.0.0.1", "localhost", "::1"):
        sys.exit("the soak runs against a loopback address only")
    server = None if args.base_url else start_server(args.port, args.max_total_tokens)
    try:
        tally, problems = asyncio.run(soak(base_url, args.api_key, args.num_requests, args.concurrency,
                                           args.max_tokens, args.request_timeout, args.seed))
    finally:
        if server is not None:
            server.terminate()
            server.wait(60)
    print(json.dumps({"requests": args.num_requests, "concurrency": args.concurrency, **tally}))
    for problem in problems[:20]:
        print("PROBLEM:", problem)
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
