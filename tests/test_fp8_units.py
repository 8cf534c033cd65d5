"""FP8 loading without an engine: a weight and its scale narrowed together for every
slice a layer asks (block grids cut anywhere, re-quantized where the layer's groups differ),
the GPU layout (e4m3 weights + row-group scales) loaded on CPU through each layer's own
loader at TP 2, bad checkpoints and options refused naming what is wrong, and the Triton
FP8 kernels under Triton's CPU interpreter: the GEMM reading e4m3 weights, and the
attention kernels on an FP8 cache. What the interpreter cannot show: speed, and exact
rounding (its bf16 dot is not exact, so fp32; its float→e4m3 conversion rounds some values
near a power of two down a binade, so the kernels are checked against what they stored,
and the rounding itself on the GPU: tests/test_cuda_fp8.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from raypp.model.quantization import fp8
from raypp.model.quantization.checkpoint import Fp8Source, OnlineSource
from raypp.model.quantization.config import QuantConfig, UnsupportedQuantizationError
from raypp.model.quantization.resolve import resolve_quant_config
from raypp.testing.fp8_checkpoint import quantize_checkpoint

ROOT = Path(__file__).resolve().parents[1]


class _Tensor:
    """A checkpoint tensor in memory with the loader's ``read`` interface."""

    def __init__(self, t: torch.Tensor):
        self.t, self.shape = t, tuple(t.shape)

    def read(self, index):
        return self.t[index]


def _source(w: torch.Tensor, quant: QuantConfig) -> Fp8Source:
    if quant.weights == "block":
        q, s = fp8.quantize_blocks(w, quant.block)
    elif quant.weights == "channel":
        q, s = fp8.quantize_rows(w, None)
    else:
        q, s = fp8.quantize_tensor(w)
    return Fp8Source("w", _Tensor(q), "w_scale", _Tensor(s), quant, q.dtype)


BLOCK = QuantConfig("fp8", "block", block=(16, 16), scale_name="weight_scale_inv")
QUANTS = [BLOCK, QuantConfig("compressed-tensors", "channel"),
          QuantConfig("compressed-tensors", "tensor")]


@pytest.mark.parametrize("quant", QUANTS, ids=lambda q: q.weights)
def test_narrowed_weight_and_scale_equal_the_whole_dequantized(quant):
    torch.manual_seed(0)
    w = torch.randn(40, 48) * torch.logspace(-2, 1, 40)[:, None]  # rows of different ranges
    src = _source(w, quant)
    whole = src.dequantized().narrow(0, 0, 40)
    assert (whole - w).abs().max() < 0.07 * w.abs().amax(1, keepdim=True).max()  # e4m3
    for dim, start, length in [(0, 0, 40), (0, 5, 19), (0, 24, 16), (1, 16, 32), (1, 3, 20)]:
        assert torch.equal(src.dequantized().narrow(dim, start, length),
                           whole.narrow(dim, start, length))
    # the GPU layout: one scale per row (re-quantized from a block grid), or per 16 columns
    for group in (None, 16):
        for dim, start, length in [(0, 5, 19), (1, 16, 32)]:
            q = src.fp8(group).narrow(dim, start, length)
            s = src.scales(group).narrow(dim, start, length)
            assert q.dtype == fp8.FP8_DTYPE
            assert s.shape == (q.shape[0], 1 if group is None else -(-q.shape[1] // group))
            back = fp8.dequantize_rows(q, s, group)
            exact = group == 16 or quant.weights != "block"
            err = (back - whole.narrow(dim, start, length)).abs().max()
            assert err == 0 if exact else err < 0.07 * whole.abs().max()


def test_a_tp_slice_inside_a_scale_block_is_refused():
    src = _source(torch.randn(32, 48), BLOCK)
    with pytest.raises(ValueError, match="splits a 16-column FP8 scale block"):
        src.fp8(16).narrow(1, 8, 24)


def test_online_rule_is_per_row_over_the_whole_row():
    torch.manual_seed(1)
    w = torch.randn(8, 64)
    q, s = fp8.quantize_rows(w, None)
    src = OnlineSource("w", _Tensor(w))
    assert torch.equal(src.dequantized().narrow(1, 32, 32), fp8.dequantize_rows(q, s, None)[:, 32:])
    assert torch.equal(src.scales(None).narrow(1, 32, 32), s)


def _fp8_stage(model_dir: Path, quant: QuantConfig | None, fmt, tp_rank: int, tp_size: int):
    """One whole-model stage of ``model_dir`` built on CPU (``fmt``: the GPU's FP8 layout)
    at TP rank ``tp_rank`` of ``tp_size``, loaded."""
    from raypp.config import ModelConfig
    from raypp.model.base import StageSpec
    from raypp.model.layers import TPContext
    from raypp.model.loader import load_stage_weights
    from raypp.model.registry import model_class

    mc = ModelConfig(str(model_dir), quantization="fp8" if quant and quant.online else None)
    model = model_class(mc.architecture)(mc.hf_config, StageSpec(0, mc.num_layers, True, True),
                                         TPContext(tp_rank, tp_size), mc.torch_dtype, "torch",
                                         quant=fmt)
    load_stage_weights(model, mc.model, quant=mc.quant_config)
    return model


@pytest.mark.parametrize(("family", "fmt", "group"), [
    ("tiny_llama", "block", 16), ("tiny_llama", "ct-channel", None),
    ("tiny_llama", "online", None), ("tiny_qwen3_moe", "block", 16),
    ("tiny_qwen3_moe", "ct-tensor", None), ("tiny_qwen3", "ct-tensor", None)])
def test_gpu_layout_loads_what_cpu_dequantizes(request, tmp_path, family, fmt, group):
    """The e4m3 weights and row-group scales an FP8 layer (GPU) holds, dequantized, are
    the 16/32-bit weights CPU loads, on each TP rank: both go through the layer's loader."""
    from raypp.model.quantization.linear import Fp8Format

    src = request.getfixturevalue(family)
    model_dir = src if fmt == "online" else quantize_checkpoint(src, tmp_path / fmt, fmt)
    quant = QuantConfig("online", "channel") if fmt == "online" else None
    for rank in range(2):
        cpu = dict(_fp8_stage(model_dir, quant, None, rank, 2).named_parameters())
        gpu = dict(_fp8_stage(model_dir, quant, Fp8Format(group), rank, 2).named_parameters())
        scaled = [n for n in gpu if n.endswith("_scale")]
        assert scaled and set(gpu) - set(cpu) == set(scaled)
        for name in scaled:
            weight = gpu[name[: -len("_scale")]]
            assert weight.dtype == fp8.FP8_DTYPE
            assert torch.equal(fp8.dequantize_rows(weight, gpu[name], group),
                               cpu[name[: -len("_scale")]]), name


# -- bad checkpoints and options ----------------------------------------------------------


def _edit(model_dir: Path, edit) -> None:
    file = model_dir / "model.safetensors"
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


@pytest.mark.parametrize(("edit", "message"), [
    (lambda t: t.pop("model.layers.3.mlp.down_proj.weight_scale_inv"),
     r"model\.layers\.3\.mlp\.down_proj\.weight is float8_e4m3fn but the checkpoint has no "
     r"model\.layers\.3\.mlp\.down_proj\.weight_scale_inv"),
    (lambda t: t.update({"model.layers.2.self_attn.k_proj.weight_scale_inv": torch.ones(3, 3)}),
     r"model\.layers\.2\.self_attn\.k_proj\.weight_scale_inv has shape \[3, 3\].*\[2, 4\]"),
    (lambda t: t.update({"model.layers.1.self_attn.k_scale": torch.ones(2)}),
     r"model\.layers\.1\.self_attn\.k_scale has shape \[2\]"),
])
def test_bad_scales_are_load_errors_naming_the_tensor(tiny_llama, tmp_path, edit, message):
    model_dir = quantize_checkpoint(tiny_llama, tmp_path / "q", "block")
    _edit(model_dir, edit)
    with pytest.raises(ValueError, match=message):
        _fp8_stage(model_dir, None, None, 0, 1)


def test_fp8_tensors_without_a_quantization_config_are_refused(tiny_llama, tmp_path):
    model_dir = quantize_checkpoint(tiny_llama, tmp_path / "q", "ct-channel")
    config = json.loads((model_dir / "config.json").read_text())
    del config["quantization_config"]
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="float8_e4m3fn but .*no quantization_config"):
        _fp8_stage(model_dir, None, None, 0, 1)


def _ct(preset: str) -> dict:
    from compressed_tensors.quantization import QuantizationConfig

    config = QuantizationConfig.model_validate({"config_groups": {preset: ["Linear"]},
                                                "format": "float-quantized"})
    return {**config.model_dump(mode="json"), "quant_method": "compressed-tensors"}


@pytest.mark.parametrize(("qc", "option", "message"), [
    ({"quant_method": "awq", "bits": 4}, None, r"format 'awq'"),
    ({"quant_method": "gptq"}, "fp8", r"format 'gptq'"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, None, r"fmt='e5m2'"),
    ({**_ct("W8A8"), "format": "int-quantized"}, None, r"format 'int-quantized'"),
    (_ct("W8A8"), None, r"weights int 8-bit .*not supported"),
    (_ct("W4A16"), None, r"weights int 4-bit group"),
    (None, "int4", r"quantization='int4' is not supported"),
])
def test_unsupported_formats_name_the_format(qc, option, message):
    config = {} if qc is None else {"quantization_config": qc}
    with pytest.raises(UnsupportedQuantizationError, match=message):
        resolve_quant_config(config, option)


def test_supported_formats_resolve():
    assert resolve_quant_config({}, None) is None
    assert resolve_quant_config({}, "fp8").online
    block = resolve_quant_config({"quantization_config": {
        "quant_method": "fp8", "weight_block_size": [128, 128]}}, None)
    assert (block.weights, block.block, block.scale_name) == ("block", (128, 128),
                                                             "weight_scale_inv")
    dynamic = resolve_quant_config({"quantization_config": _ct("FP8_DYNAMIC")}, None)
    assert (dynamic.weights, dynamic.activations) == ("channel", "dynamic")
    static = resolve_quant_config({"quantization_config": _ct("FP8")}, None)
    assert (static.weights, static.activations) == ("tensor", "static")


def test_kv_cache_dtype_option():
    from raypp.config import CacheConfig

    assert CacheConfig(kv_cache_dtype="fp8_e4m3").kv_torch_dtype(torch.bfloat16) == fp8.FP8_DTYPE
    assert CacheConfig().kv_torch_dtype(torch.bfloat16) == torch.bfloat16
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        CacheConfig(kv_cache_dtype="int8")


def test_cli_flags_reach_the_config(tiny_llama):
    import argparse

    from raypp.entrypoints.args import add_engine_args, engine_config

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = engine_config(str(tiny_llama), parser.parse_args(
        ["--quantization", "fp8", "--kv-cache-dtype", "fp8", "--device", "cpu"]))
    assert config.model.quant_config.online and config.cache.kv_cache_dtype == "fp8"


# -- the Triton FP8 GEMM under the interpreter ----------------------------------------------

_INTERPRETED = """
import torch
from raypp.kernels.fp8_linear import fp8_gemm
from raypp.model.quantization import fp8
torch.manual_seed(0)
for m, n, k, group in [(1, 48, 96, 0), (5, 40, 64, 32), (20, 33, 80, 16), (3, 24, 40, 16)]:
    x = torch.randn(m, k)
    q, s = fp8.quantize_rows(torch.randn(n, k), group or None)
    b = torch.randn(n)
    ref = x.double() @ fp8.dequantize_rows(q, s, group or None).double().T + b.double()
    out = fp8_gemm(x, q, s, b if m % 2 else None, group, tiles=(16, 16, 16))
    if m % 2 == 0:
        ref = ref - b.double()
    err = (out.double() - ref).abs().max().item()
    assert err < 1e-4 * ref.abs().max().item(), (m, n, k, group, err)
print("ok")
"""


_FP8_KV_INTERPRETED = """
import torch
import raypp.kernels.attention as ta
from raypp.kernels.decode_attention import rope_decode_attention
from raypp.model.layers import RotaryEmbedding
torch.manual_seed(0)
blocks, bs, kvh, heads, dim = 6, 16, 2, 4, 16
ks, vs = torch.tensor(0.5), torch.tensor(0.25)
def reference(q, keys, values, scale):
    g = heads // kvh
    k = keys.double().repeat_interleave(g, 1); v = values.double().repeat_interleave(g, 1)
    s = torch.einsum("hd,nhd->hn", q.double(), k) * scale
    return torch.einsum("hn,nhd->hd", s.softmax(-1), v)
def cached(cache, table, n, scale, which):  # what the cache holds, upcast as torch does
    return cache[which][table].flatten(0, 1)[:n].float() * scale
cache = torch.zeros(2, blocks, bs, kvh, dim, dtype=torch.float8_e4m3fn)
seqs, lens = 2, [21, 40]
tables = torch.tensor([[3, 1, 0], [2, 5, 4]])
keys = [torch.randn(n, kvh, dim) * 3 for n in lens]
values = [torch.randn(n, kvh, dim) for n in lens]
for j in range(seqs):
    slots = torch.tensor([int(tables[j, t // bs]) * bs + t % bs for t in range(lens[j])])
    ta.store_kv(keys[j], values[j], cache[0], cache[1], slots, ks, vs)
for j in range(seqs):  # stored scaled: x / scale, within e4m3's coarsest error of x
    k = cached(cache, tables[j], lens[j], ks, 0)
    assert (k - keys[j]).abs().max() < 0.55 * keys[j].abs().max(), (k - keys[j]).abs().max()
for splits in (1, 3):
    q = torch.randn(seqs, heads, dim)
    out = ta.paged_decode(q, cache[0], cache[1], tables, torch.tensor(lens), dim ** -0.5,
                          splits=splits, k_scale=ks, v_scale=vs)
    for j in range(seqs):
        ref = reference(q[j], cached(cache, tables[j], lens[j], ks, 0),
                        cached(cache, tables[j], lens[j], vs, 1), dim ** -0.5)
        assert (out[j].double() - ref).abs().max() < 1e-5
rot = RotaryEmbedding(dim, 128, 10000.0, None)
qkv = torch.randn(seqs, (heads + 2 * kvh) * dim)
pos = torch.tensor(lens)
slot_new = torch.tensor([int(tables[j, lens[j] // bs]) * bs + lens[j] % bs for j in range(seqs)])
got = rope_decode_attention(qkv, pos, rot.cos, rot.sin, cache, slot_new, tables,
                            torch.tensor(lens) + 1, heads, dim ** -0.5, False, splits=2,
                            k_scale=ks, v_scale=vs)
qr, _ = rot(pos, qkv[:, : heads * dim].view(seqs, heads, dim), qkv[:, : kvh * dim].view(seqs, kvh, dim))
for j in range(seqs):  # this step's token attended to as stored, like every cached one
    n = lens[j] + 1
    ref = reference(qr[j], cached(cache, tables[j], n, ks, 0), cached(cache, tables[j], n, vs, 1),
                    dim ** -0.5)
    assert (got[j].view(heads, dim).double() - ref).abs().max() < 1e-5
print("ok")
"""


@pytest.mark.parametrize("script", [_INTERPRETED, _FP8_KV_INTERPRETED], ids=["gemm", "fp8-kv"])
def test_fp8_kernels_under_the_triton_interpreter(script):
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT / "src")}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]
