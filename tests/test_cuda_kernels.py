"""Every kernel of :mod:`raypp.kernels` against a plain PyTorch reference (float64 where
it matters): paged attention, the fused decode chain's RMSNorm, GEMV, GEMM and
rotary+attention, and the sampling kernels. Skipped cleanly without a GPU (CI); the
GPU call runs it.

The chain end to end (graph replay vs the eager forward, the engine vs transformers) is
in tests/test_cuda.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from cuda_reference import pdl_modes, ref_decode, rel

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]


TOLERANCES = [(torch.float32, 1e-5), (torch.bfloat16, 1e-2), (torch.float16, 2e-3)]


@pytest.mark.parametrize("dtype,tol", TOLERANCES)
@pytest.mark.parametrize("n,k", [(3072, 2048), (2048, 8192), (100, 64), (96, 200)])
@pytest.mark.parametrize("gated", [False, True])
def test_gemv_matches_linear(dtype, tol, n, k, gated):
    """One row times a weight (uneven N and K included), with bias, or gate/up with SiLU."""
    from raypp.kernels.linear import gemv

    gen = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(2 * n if gated else n, k, device="cuda", generator=gen) * 0.05).to(dtype)
    x = torch.randn(1, k, device="cuda", generator=gen).to(dtype)
    bias = None if gated else torch.randn(n, device="cuda", generator=gen).to(dtype)
    want = F.linear(x.double(), w.double(), None if bias is None else bias.double())
    if gated:
        want = F.silu(want[:, :n]) * want[:, n:]
    for pdl in pdl_modes():
        got = gemv(x, w, bias, gated, pdl)
        assert got.shape == (1, n) and got.dtype == dtype
        assert rel(got, want) < tol, pdl


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
    from raypp.kernels.counters import split_counters
    from raypp.kernels.linear import gemm

    gen = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(2 * n if gated else n, k, device="cuda", generator=gen) * 0.05).to(dtype)
    x = torch.randn(m, k, device="cuda", generator=gen).to(dtype)
    bias = None if gated else torch.randn(n, device="cuda", generator=gen).to(dtype)
    want = F.linear(x.double(), w.double(), None if bias is None else bias.double())
    if gated:
        want = F.silu(want[:, :n]) * want[:, n:]
    for pdl in pdl_modes():
        got = gemm(x, w, bias, gated, pdl, config)
        assert got.shape == (m, n) and got.dtype == dtype
        assert rel(got, want) < tol, pdl
        assert torch.equal(gemm(x, w, bias, gated, pdl, config), got)
    assert not split_counters(x.device, 1).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("size", [2048, 64, 896])
def test_rms_norm_matches_module(dtype, size):
    from raypp.kernels.norm import rms_norm
    from raypp.model.layers import RMSNorm

    torch.manual_seed(0)
    norm = RMSNorm(size, 1e-5, dtype).cuda()
    norm.weight.data.normal_()
    x, res = (torch.randn(1, size, device="cuda").to(dtype) for _ in range(2))
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 8e-3,
                                                                       "atol": 1e-3}
    want, want_res = norm(x, res)
    want_plain = norm(x)
    for pdl in pdl_modes():
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
    from raypp.kernels import attention as ta
    from raypp.kernels import counters
    from raypp.kernels.decode_attention import rope_decode_attention
    from raypp.model.layers import RotaryEmbedding

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
    for pdl in pdl_modes():
        got_cache = cache.clone()
        got = rope_decode_attention(qkv, positions, rotary.cos, rotary.sin, got_cache,
                                    slot_mapping, tables, seq_lens, heads, dim**-0.5, pdl,
                                    splits=splits)
        assert got.shape == (rows, heads * dim) and got.dtype == dtype
        assert rel(got, want) < tol, pdl
        if 0 in context:
            assert not got[context.index(0)].any()
        written = slot_mapping[slot_mapping >= 0]
        flat = (-1, kv_heads, dim)
        assert rel(got_cache.view(2, *flat)[:, written], want_cache.view(2, *flat)[:, written]) < tol
        untouched = torch.ones(blocks * block_size, dtype=torch.bool, device="cuda")
        untouched[written] = False
        assert torch.equal(got_cache.view(2, *flat)[:, untouched], cache.view(2, *flat)[:, untouched])
    left = counters._COUNTERS.get(torch.device("cuda", torch.cuda.current_device()))
    assert left is None or not left.any()  # the split combine left them zero


# -- paged attention ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2),
                                       (torch.float16, 2e-3)])
@pytest.mark.parametrize("heads,kv_heads,dim", [(32, 8, 64), (4, 2, 16), (8, 8, 128)])
def test_paged_decode_matches_reference(dtype, tol, heads, kv_heads, dim):
    from raypp.kernels import attention as ta
    from raypp.kernels.tuning import DecodeLaunch

    gen = torch.Generator(device="cuda").manual_seed(heads * dim)
    dev = "cuda"
    blocks, block_size, width = 300, 16, 40
    key_cache = torch.randn(blocks, block_size, kv_heads, dim, device=dev, generator=gen).to(dtype)
    value_cache = torch.randn_like(key_cache.float()).to(dtype)
    seq_lens = torch.tensor([1, 0, 17, 64, 65, 300, 640], device=dev)
    tables = torch.stack([torch.randperm(blocks, device=dev, generator=gen)[:width]
                          for _ in range(len(seq_lens))])
    q = torch.randn(len(seq_lens), heads, dim, device=dev, generator=gen).to(dtype)
    scale = dim**-0.5
    ref = ref_decode(q, key_cache, value_cache, tables, seq_lens, scale)
    for splits in (None, 1, 2, 7, 32):
        out = ta.paged_decode(q, key_cache, value_cache, tables, seq_lens, scale, splits=splits)
        assert torch.isfinite(out).all()
        assert out[1].abs().max() == 0  # empty context: zeros
        assert rel(out, ref) < tol, (splits, rel(out, ref))
    # int32 block tables read the same
    out32 = ta.paged_decode(q, key_cache, value_cache, tables.int(), seq_lens, scale)
    assert rel(out32, ref) < tol
    # every launch shape the benchmark's sweep tries computes the same attention
    for launch in (DecodeLaunch(32, 4, 1), DecodeLaunch(128, 8, 4), DecodeLaunch(64, 4, 3)):
        for splits in (1, 5):
            out = ta.paged_decode(q, key_cache, value_cache, tables, seq_lens, scale,
                                  splits=splits, launch=launch)
            assert rel(out, ref) < tol, (launch, splits, rel(out, ref))


def test_store_kv_skips_negative_slots():
    from raypp.kernels import attention as ta

    kv = torch.randn(2, 10, 16, 2, 8, device="cuda")
    qkv = torch.randn(5, 3 * 16, device="cuda")  # k, v as strided views, as in the model
    k = qkv[:, 16:32].view(5, 2, 8)
    v = qkv[:, 32:].view(5, 2, 8)
    slots = torch.tensor([3, -1, 17, 159, 5], device="cuda")
    expected = kv.clone()
    keep = slots >= 0
    expected[0].view(-1, 2, 8)[slots[keep]] = k[keep]
    expected[1].view(-1, 2, 8)[slots[keep]] = v[keep]
    ta.store_kv(k, v, kv[0], kv[1], slots)
    assert torch.equal(kv, expected)


def test_mixed_batch_matches_cpu_path():
    """Fresh prefill, a later prefill chunk and decode rows in one step: as the CPU path."""
    from raypp.kernels import attention as ta
    from raypp.model.attention import AttentionMetadata, PagedAttention
    from raypp.model.layers import RotaryEmbedding

    torch.manual_seed(0)
    heads, kv_heads, dim, block_size, blocks = 8, 2, 32, 16, 64
    attn = PagedAttention(heads, kv_heads, dim, RotaryEmbedding(dim, 128, 10000.0, None), "torch")
    perm = torch.randperm(blocks).tolist()
    tables = [perm[0:2], perm[2:6], perm[6:11], perm[11:12]]
    query_lens, seq_lens = [20, 10, 1, 1], [20, 50, 70, 1]
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    slots = [t[p // block_size] * block_size + p % block_size
             for t, n, total in zip(tables, query_lens, seq_lens, strict=True)
             for p in range(total - n, total)]
    width = max(map(len, tables))

    def meta(device):
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, device=device), query_start=starts,
            seq_lens=seq_lens, decode_only=False,
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], device=device),
            seq_lens_tensor=torch.tensor(seq_lens, device=device))

    tokens = starts[-1]
    q, k, v = (torch.randn(tokens, h, dim) for h in (heads, kv_heads, kv_heads))
    cache = torch.randn(2, blocks, block_size, kv_heads, dim)
    cpu_cache, gpu_cache = cache.clone(), cache.cuda()
    ref = attn._torch_attention(q, k, v, cpu_cache, meta("cpu"))
    out = ta.paged_attention(q.cuda(), k.cuda(), v.cuda(), gpu_cache, meta("cuda"), attn.scale)
    assert rel(out.cpu(), ref) < 1e-5
    assert torch.allclose(gpu_cache.cpu(), cpu_cache)


# -- sampling ------------------------------------------------------------------------------


def test_chunked_argmax_equals_torch_argmax():
    from raypp.worker.sampler import argmax

    gen = torch.Generator(device="cuda").manual_seed(0)
    for rows, vocab in ((1, 128256), (4, 32000), (8, 151936), (3, 1000)):
        logits = torch.randn(rows, vocab, device="cuda", generator=gen)
        logits[0, vocab // 3] = logits[0, vocab - 5] = 1e4  # a tie: the first index wins
        assert torch.equal(argmax(logits), logits.argmax(dim=-1))
        assert argmax(logits)[0].item() == vocab // 3


def _decode_inputs_pair(rows: int, width: int, block_size: int, gen: torch.Generator):
    """The same random decode inputs on the CPU and on the GPU."""
    from raypp.worker.decode_loop import DecodeInputs

    positions = torch.randint(0, width * block_size - 1, (rows,), generator=gen)
    cpu = DecodeInputs(torch.zeros(rows, dtype=torch.int64), positions.clone(),
                       torch.zeros(rows, dtype=torch.int64), positions + 1,
                       torch.randint(0, 1000, (rows, width), generator=gen))
    gpu = DecodeInputs(*(t.cuda() for t in (cpu.input_ids, cpu.positions, cpu.slot_mapping,
                                            cpu.seq_lens, cpu.block_tables)))
    return cpu, gpu


def _assert_same_inputs(gpu, cpu) -> None:
    for name in ("input_ids", "positions", "slot_mapping", "seq_lens"):
        assert torch.equal(getattr(gpu, name).cpu(), getattr(cpu, name)), name


def test_triton_advance_equals_torch_ops():
    """One Triton launch moves a decode batch to its next step exactly as the CPU ops do."""
    block_size, rows, width = 16, 300, 8
    gen = torch.Generator().manual_seed(0)
    cpu, gpu = _decode_inputs_pair(rows, width, block_size, gen)
    tokens = torch.randint(0, 50000, (rows,), generator=gen)
    cpu.advance(tokens, block_size)
    gpu.advance(tokens.cuda(), block_size)
    _assert_same_inputs(gpu, cpu)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,vocab", [(1, 128256), (300, 1000), (3, 4096)])
def test_greedy_step_equals_argmax_then_advance(dtype, rows, vocab):
    """The two-launch greedy step: torch's argmax (first index on ties, rows of -inf or
    only negative logits), written into one column, and the inputs advanced as the CPU
    ops advance them; the keys are left empty for the next step."""
    from raypp.kernels.sampling import EMPTY_KEY, greedy_step

    block_size, width = 16, 8
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, vocab, generator=gen).to(dtype)
    logits[0, vocab // 3] = logits[0, vocab - 5] = 100.0
    if rows > 2:
        logits[1] = float("-inf")
        logits[2] = -logits[2].abs() - 1
    cpu, gpu = _decode_inputs_pair(rows, width, block_size, gen)
    want = logits.argmax(dim=-1)
    cpu.advance(want, block_size)
    keys = torch.full((rows,), EMPTY_KEY, dtype=torch.int64, device="cuda")
    out = torch.zeros(rows, 3, dtype=torch.int64, device="cuda")
    greedy_step(logits.cuda(), keys, out[:, 1], gpu.kernel_tensors(), block_size)
    assert torch.equal(out[:, 1].cpu(), want)
    assert not out[:, 0].any() and not out[:, 2].any()
    assert bool((keys == EMPTY_KEY).all())
    _assert_same_inputs(gpu, cpu)
    greedy_step(logits.cuda(), keys, out[:, 2], None, block_size)  # no advance
    assert torch.equal(out[:, 2].cpu(), want)
    assert torch.equal(gpu.positions.cpu(), cpu.positions)
