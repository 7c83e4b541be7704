"""The shipped head's weights in every published layout, on the default model: each loads,
speculates exactly, and serves a 3,000-token prompt although it declares 2,048 positions;
through the server, that prompt leaves the server healthy and answering."""

from __future__ import annotations

import pytest
from conftest import engine_config
from eagle3_helpers import spec_config
from published_heads import LAYOUTS, write_layout
from server_fixtures import LiveServer

from eaglesrv.engine.llm_engine import Engine
from eaglesrv.engine.loader import resolve_model
from eaglesrv.heads import DEFAULT_MODEL_HEAD
from eaglesrv.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

LONG = 3000
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def plain():
    return Engine(engine_config(None))


@pytest.fixture(scope="module")
def prompts(plain):
    lines = "\n".join(
        f"Entry {i}: the shipment of {i * 7 % 13} crates left port {i % 5} on day {i}." for i in range(400))
    long_prompt = plain.encode(lines)[:LONG]
    assert len(long_prompt) == LONG
    short = plain.encode("<|im_start|>user\nName three rivers in Europe.<|im_end|>\n<|im_start|>assistant\n")
    return [short, long_prompt]


@pytest.fixture(scope="module")
def expected(plain, prompts):
    return [r.output_token_ids for r in plain.generate(prompts, GREEDY)]


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    embedding = dict(resolve_model(None).iter_weights())["model.embed_tokens.weight"]
    root = tmp_path_factory.mktemp("published")
    return {layout: write_layout(str(DEFAULT_MODEL_HEAD), layout, root / layout, embedding) for layout in LAYOUTS}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_layout_equals_plain_past_2048_positions(layouts, prompts, expected, layout):
    engine = Engine(spec_config(None, layouts[layout], 3, 1, 4))
    assert [r.output_token_ids for r in engine.generate(prompts, GREEDY)] == expected
    stats = engine.spec_stats
    assert stats["spec_verifications"] > 0
    if layout != "specforge_fc_norm":  # the shipped head, stored differently: it still drafts well
        assert stats["avg_spec_accept_length"] > 1.5


def test_a_long_prompt_leaves_the_server_healthy(layouts, prompts, expected):
    server = LiveServer(
        "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", layouts["eagle_bin_fp16"],
        "--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4",
        "--max-total-tokens", "8192", "--disable-speculative-adaptive",
    )
    try:
        with server.wait_healthy().client() as http:
            sampling = {"temperature": 0, "max_new_tokens": GREEDY.max_tokens, "ignore_eos": True}
            long_reply = http.post("/generate", json={"input_ids": prompts[1], "sampling_params": sampling}).json()
            assert long_reply["output_ids"] == expected[1]
            assert http.get("/health").status_code == 200
            short = http.post("/generate", json={"input_ids": prompts[0], "sampling_params": sampling}).json()
            assert short["output_ids"] == expected[0]
            assert http.get("/get_server_info").json()["internal_states"][0]["avg_spec_accept_length"] > 1.0
    finally:
        server.stop()
    assert server.process.returncode == 0
