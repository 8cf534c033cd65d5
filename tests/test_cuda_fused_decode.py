"""The kernels of the fused decode chain (raypp.model.triton_decode) against the unfused
ops they replace. Skipped cleanly without a GPU (CI); the GPU call runs it.

The chain end to end (graph replay vs the eager forward, the engine vs transformers) is
in tests/test_cuda.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _pdl_modes() -> tuple[bool, ...]:
    from raypp.model.triton_decode import pdl_supported

    return (False, True) if pdl_supported(torch.device("cuda")) else (False,)


TOLERANCES = [(torch.float32, 1e-5), (torch.bfloat16, 1e-2), (torch.float16, 2e-3)]


@pytest.mark.parametrize("dtype,tol", TOLERANCES)
@pytest.mark.parametrize("n,k", [(3072, 2048), (2048, 8192), (100, 64), (96, 200)])
@pytest.mark.parametrize("gated", [False, True])
def test_gemv_matches_linear(dtype, tol, n, k, gated):
    """One row times a weight (uneven N and K included), with bias, or gate/up with SiLU."""
    from raypp.model.triton_decode import gemv

    gen = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(2 * n if gated else n, k, device="cuda", generator=gen) * 0.05).to(dtype)
    x = torch.randn(1, k, device="cuda", generator=gen).to(dtype)
    bias = None if gated else torch.randn(n, device="cuda", generator=gen).to(dtype)
    want = F.linear(x.double(), w.double(), None if bias is None else bias.double())
    if gated:
        want = F.silu(want[:, :n]) * want[:, n:]
    for pdl in _pdl_modes():
        got = gemv(x, w, bias, gated, pdl)
        assert got.shape == (1, n) and got.dtype == dtype
        assert _rel(got, want) < tol, pdl


@pytest.mark.parametrize("dtype,tol", TOLERANCES)
@pytest.mark.parametrize("m,n,k", [(64, 3072, 2048), (16, 2048, 8192), (5, 100, 64),
                                   (33, 96, 200)])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("config", [None, (32, 64, 3, 4, 1), (16, 32, 1, 8, 1),
                                    (64, 64, 2, 4, 3)])
def test_gemm_matches_linear(dtype, tol, m, n, k, gated, config):
    """A decode batch times a weight (uneven M, N and K; with bias, or gate/up with SiLU),
    at the default settings, split over K (uneven splits), unsplit, and software-pipelined;
    the same bits on a second call (the splits are summed in a fixed order) and the
    counters left zero."""
    from raypp.model.triton_decode import _split_counters, gemm

    gen = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(2 * n if gated else n, k, device="cuda", generator=gen) * 0.05).to(dtype)
    x = torch.randn(m, k, device="cuda", generator=gen).to(dtype)
    bias = None if gated else torch.randn(n, device="cuda", generator=gen).to(dtype)
    want = F.linear(x.double(), w.double(), None if bias is None else bias.double())
    if gated:
        want = F.silu(want[:, :n]) * want[:, n:]
    for pdl in _pdl_modes():
        got = gemm(x, w, bias, gated, pdl, config)
        assert got.shape == (m, n) and got.dtype == dtype
        assert _rel(got, want) < tol, pdl
        assert torch.equal(gemm(x, w, bias, gated, pdl, config), got)
    assert not _split_counters(x.device, 1).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("size", [2048, 64, 896])
def test_rms_norm_matches_module(dtype, size):
    from raypp.model.layers import RMSNorm
    from raypp.model.triton_decode import rms_norm

    torch.manual_seed(0)
    norm = RMSNorm(size, 1e-5, dtype).cuda()
    norm.weight.data.normal_()
    x, res = (torch.randn(1, size, device="cuda").to(dtype) for _ in range(2))
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 8e-3,
                                                                       "atol": 1e-3}
    want, want_res = norm(x, res)
    want_plain = norm(x)
    for pdl in _pdl_modes():
        got, got_res = rms_norm(x, res, norm.weight, norm.eps, pdl)
        assert torch.equal(got_res, want_res)
        torch.testing.assert_close(got, want, **tol)
        got, same = rms_norm(x, None, norm.weight, norm.eps, pdl)
        assert same is x
        torch.testing.assert_close(got, want_plain, **tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2),
                                       (torch.float16, 4e-3)])
@pytest.mark.parametrize("heads,kv_heads,dim", [(32, 8, 64), (4, 2, 16), (8, 8, 128)])
@pytest.mark.parametrize("rows,splits", [(1, None), (5, None), (5, 1)])
def test_rope_decode_attention_matches_unfused(dtype, tol, heads, kv_heads, dim, rows, splits):
    """Rotary + KV store + attention from the raw qkv row == RotaryEmbedding then the
    paged decode kernels: same outputs, same cache; a padding row (slot -1, no context)
    writes nothing and gives zeros; a row whose only context is this step's token; the
    splits combined in-kernel (``splits`` None: several) or one split."""
    from raypp.model import triton_attention as ta
    from raypp.model import triton_decode as td
    from raypp.model.layers import RotaryEmbedding
    from raypp.model.triton_decode import rope_decode_attention

    torch.manual_seed(0)
    block_size, blocks, width = 16, 128, 16
    context = [200, 1, 0, 17, 256][:rows]
    tables = torch.randperm(blocks)[: rows * width].view(rows, width).cuda()
    slots = [int(tables[i, (c - 1) // block_size]) * block_size + (c - 1) % block_size
             if c else -1 for i, c in enumerate(context)]
    positions = torch.tensor([max(c - 1, 0) for c in context], device="cuda")
    slot_mapping = torch.tensor(slots, device="cuda")
    seq_lens = torch.tensor(context, device="cuda")
    rotary = RotaryEmbedding(dim, 4096, 500000.0, None).cuda()
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, device="cuda").to(dtype)
    cache = torch.randn(2, blocks, block_size, kv_heads, dim, device="cuda").to(dtype)

    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k = rotary(positions, q.reshape(rows, heads, dim), k.reshape(rows, kv_heads, dim))
    want_cache = cache.clone()
    ta.store_kv(k, v.reshape(rows, kv_heads, dim), want_cache[0], want_cache[1], slot_mapping)
    want = ta.paged_decode(q, want_cache[0], want_cache[1], tables, seq_lens, dim**-0.5)
    want = want.reshape(rows, heads * dim)
    for pdl in _pdl_modes():
        got_cache = cache.clone()
        got = rope_decode_attention(qkv, positions, rotary.cos, rotary.sin, got_cache,
                                    slot_mapping, tables, seq_lens, heads, dim**-0.5, pdl,
                                    splits=splits)
        assert got.shape == (rows, heads * dim) and got.dtype == dtype
        assert _rel(got, want) < tol, pdl
        if 0 in context:
            assert not got[context.index(0)].any()
        written = slot_mapping[slot_mapping >= 0]
        flat = (-1, kv_heads, dim)
        assert _rel(got_cache.view(2, *flat)[:, written], want_cache.view(2, *flat)[:, written]) < tol
        untouched = torch.ones(blocks * block_size, dtype=torch.bool, device="cuda")
        untouched[written] = False
        assert torch.equal(got_cache.view(2, *flat)[:, untouched], cache.view(2, *flat)[:, untouched])
    counters = td._COUNTERS.get(torch.device("cuda", torch.cuda.current_device()))
    assert counters is None or not counters.any()  # the split combine left them zero
