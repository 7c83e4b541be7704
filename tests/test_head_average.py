"""scripts/average_heads.py: the weighted mean of EAGLE-3 heads' weights, the vocabulary maps
kept, and a clear refusal of heads that cannot be combined."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from eagle3_helpers import save_random_head
from safetensors.torch import load_file, save_file

from eaglesrv.engine.eagle3.head_io import load_draft_head
from eaglesrv.engine.loader import resolve_model
from eaglesrv.engine.model.arch import ModelArch

spec = importlib.util.spec_from_file_location("average_heads", Path(__file__).parents[1] / "scripts/average_heads.py")
average_heads = importlib.util.module_from_spec(spec)
spec.loader.exec_module(average_heads)
HeadAverageError, main, parse_weighted = (
    average_heads.HeadAverageError, average_heads.main, average_heads.parse_weighted)


@pytest.fixture(scope="module")
def two_heads(tiny_llama_dir, tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("heads")
    return (Path(save_random_head(tiny_llama_dir, root / "a", seed=0)),
            Path(save_random_head(tiny_llama_dir, root / "b", seed=1)))


def test_average_is_the_weighted_mean_and_loads(two_heads, tiny_llama_dir, tmp_path):
    a, b = two_heads
    out = main(["--output-dir", str(tmp_path / "avg"), str(a), f"{b}:3"])
    mean, wa, wb = load_file(str(out / "model.safetensors")), load_file(str(a / "model.safetensors")), \
        load_file(str(b / "model.safetensors"))
    assert mean.keys() == wa.keys()
    for name, tensor in mean.items():
        if tensor.is_floating_point():
            assert not torch.equal(wa[name], wb[name]) or name.endswith("norm.weight")
            torch.testing.assert_close(tensor, 0.25 * wa[name] + 0.75 * wb[name])
        else:
            assert torch.equal(tensor, wa[name])  # d2t / t2d copied
    record = json.loads((out / "AVERAGE.json").read_text())
    assert [h["weight"] for h in record["heads"]] == [0.25, 0.75]
    assert json.loads((out / "config.json").read_text()) == json.loads((a / "config.json").read_text())

    source = resolve_model(tiny_llama_dir)
    embedding = dict(source.iter_weights())["model.embed_tokens.weight"]
    head = load_draft_head(str(out), ModelArch.from_hf_config(source.hf_config), embedding, torch.float32,
                           torch.device("cpu"))
    fc = head.state_dict()["fc.weight"]
    torch.testing.assert_close(fc, 0.25 * wa["fc.weight"] + 0.75 * wb["fc.weight"])


def test_a_negative_weight_steps_past_the_other_head(two_heads, tmp_path):
    a, b = two_heads
    out = main(["--output-dir", str(tmp_path / "past"), f"{a}:1.5", f"{b}:-0.5"])
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    torch.testing.assert_close(load_file(str(out / "model.safetensors"))["fc.weight"],
                               1.5 * wa["fc.weight"] - 0.5 * wb["fc.weight"])


def test_heads_with_different_vocabularies_are_refused(two_heads, tmp_path, capsys):
    a, b = two_heads
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text((b / "config.json").read_text())
    tensors = load_file(str(b / "model.safetensors"))
    tensors["d2t"] = (torch.roll(tensors["d2t"] + torch.arange(len(tensors["d2t"])), 1)
                      - torch.arange(len(tensors["d2t"])))
    save_file(tensors, str(other / "model.safetensors"))
    with pytest.raises(SystemExit):
        main(["--output-dir", str(tmp_path / "avg"), str(a), str(other)])
    assert "different draft vocabularies" in capsys.readouterr().err
    assert not (tmp_path / "avg").exists()


@pytest.mark.parametrize("args, message", [
    (["{a}"], "at least two heads"),
    (["{a}", "{missing}"], "model.safetensors is missing"),
    (["{a}", "{b}:0"], "nonzero number"),
    (["{a}", "{b}:nan"], "nonzero number"),
    (["{a}", "{b}:-1"], "sum to a positive number"),
])
def test_bad_arguments_get_a_clear_error(two_heads, tmp_path, capsys, args, message):
    (tmp_path / "missing").mkdir()
    (tmp_path / "missing" / "config.json").write_text("{}")
    names = {"a": two_heads[0], "b": two_heads[1], "missing": tmp_path / "missing"}
    with pytest.raises(SystemExit):
        main(["--output-dir", str(tmp_path / "avg")] + [arg.format(**names) for arg in args])
    assert message in capsys.readouterr().err


def test_weight_suffix_parsing():
    assert parse_weighted("heads/s14:2.5") == (Path("heads/s14"), 2.5)
    assert parse_weighted("heads/s14") == (Path("heads/s14"), 1.0)
    assert parse_weighted("a:b") == (Path("a:b"), 1.0)  # a colon in the name, no weight
    assert parse_weighted("s13:-0.5") == (Path("s13"), -0.5)
    with pytest.raises(HeadAverageError):
        parse_weighted("a:0")
