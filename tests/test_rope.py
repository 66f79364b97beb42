"""relpos::rope (rotary position embedding): every backend against relpos_ext.reference.rope,
its autograd (gradcheck, jvp, vmap), opcheck, torch.compile and its errors."""

from __future__ import annotations

import os

import pytest
import torch

import relpos_ext
from relpos_ext import reference as ref
from conftest import assert_close

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]

# (x shape, cos/sin shape)
CASES = [
    ((2, 3, 5, 16), (5, 16)),  # [B, H, L, D], one table for every row
    ((2, 3, 5, 16), (2, 1, 5, 16)),  # HF's cos[:, None] (unsqueeze_dim=1): per-sequence positions
    ((2, 5, 3, 16), (2, 5, 1, 16)),  # [B, L, H, D] queries, unsqueeze_dim=2
    ((1, 2, 7, 40), (7, 24)),  # partial rotary (R = 24 < D = 40): vector tails, pass-through
    ((3, 9, 6), (9, 6)),  # 3-D x, R = 6 (no full vector)
    ((2, 4, 1, 64), (2, 1, 1, 64)),  # L = 1
    ((1, 4, 33, 128), (33, 128)),  # Llama's head dim
    ((2, 2, 5, 48), (5, 40)),  # 16-wide blocks and an 8-wide tail (half-split 16 + 4 pairs)
    ((2, 3, 0, 8), (0, 8)),  # empty
    ((8,), (8,)),  # one row
    ((2, 2, 3, 10), (3, 0)),  # R = 0: a copy
    ((2, 2, 3, 11), (1, 3, 4)),  # odd D, 3-D table broadcast over the batch
]


def _tables(shape, dtype=torch.float64):
    """Arbitrary cos and sin (not a rotation: each pair's two entries differ), so that reading
    the partner's entry in place of one's own shows."""
    return torch.randn(shape, dtype=torch.float64).to(dtype), torch.randn(shape).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("inverse", [False, True])
def test_rope_matches_reference(backend, dtype, case, interleaved, inverse):
    xs, cs = case
    x = torch.randn(xs, dtype=torch.float64).to(dtype)
    cos, sin = _tables(cs, dtype)
    got = backend.op("rope")(backend.tensor(x), backend.tensor(cos), backend.tensor(sin),
                             interleaved, inverse)
    expected = ref.rope(x.double(), cos.double(), sin.double(), interleaved, inverse)
    assert got.shape == x.shape and got.is_contiguous()
    assert_close(got, expected, dtype)
    if backend.name != "cuda":  # nvcc fuses multiply-adds; the CPU paths and the emulator don't
        # the reference's own roundings (products, then their sum, in float32 for the 16-bit
        # dtypes), bit for bit
        assert torch.equal(got.cpu(), ref.rope(x, cos, sin, interleaved, inverse))
    # the pass-through features are copied exactly
    assert torch.equal(got.cpu()[..., cs[-1]:], x[..., cs[-1]:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_non_finite(backend, dtype, interleaved):
    # NaN and infinities flow through as in the reference, in the 16-wide blocks and in the
    # tails; values near the dtype's max may overflow to infinity, as there. (NaN's bits are not
    # compared: the kernels round NaN to c10's 0x7FC0, ATen's vectorised cast to 0xFFFF.)
    x = torch.randn(3, 4, 56, dtype=torch.float64).to(dtype)
    big = torch.finfo(dtype).max
    x[0, 0, :6] = torch.tensor([float("nan"), float("inf"), -float("inf"), big, -big, 0.0])
    x[1, 2, 40:48] = float("nan")
    x[2, 3, 17] = float("inf")
    cos, sin = _tables((4, 56), dtype)
    got = backend.op("rope")(backend.tensor(x), backend.tensor(cos), backend.tensor(sin),
                             interleaved, False).cpu()
    want = ref.rope(x, cos, sin, interleaved, False)
    assert torch.equal(got.isnan(), want.isnan())
    if backend.name != "cuda":
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_strided_inputs(backend, dtype):
    # [B, L, H, D] memory seen as [B, H, L, D], and tables that are a slice of a wider cache
    x = torch.randn(2, 7, 3, 24, dtype=dtype).transpose(1, 2)
    cache = torch.randn(2, 7, 40, dtype=dtype)
    cos, sin = cache[..., :16].unsqueeze(1), cache[..., 20:36].unsqueeze(1)
    assert not (x.is_contiguous() or cos.is_contiguous())
    got = backend.op("rope")(backend.tensor(x), backend.tensor(cos), backend.tensor(sin), False,
                             False)
    assert_close(got, ref.rope(x.double(), cos.double(), sin.double()), dtype)


def test_rope_tables_in_another_dtype_are_cast_first(backend):
    # HF casts cos and sin to the queries' dtype before multiplying; so does the op
    x = torch.randn(2, 2, 6, 16, dtype=torch.bfloat16)
    cos, sin = _tables((6, 16), torch.float32)
    got = backend.op("rope")(backend.tensor(x), backend.tensor(cos), backend.tensor(sin), True,
                             False)
    assert got.dtype == torch.bfloat16
    expected = ref.rope(x.double(), cos.bfloat16().double(), sin.bfloat16().double(), True)
    assert_close(got, expected, torch.bfloat16)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_is_a_rotation(cpu_isa, interleaved):
    # with cos and sin of real angles the op turns each pair: norms kept, inverse undoes it
    x = torch.randn(2, 4, 50, 32)
    inv_freq, _ = relpos_ext.positions.rope_inv_freq(24)
    cos, sin = relpos_ext.positions.rope_cos_sin(inv_freq, torch.arange(50) + 3,
                                                 interleaved=interleaved)
    y = relpos_ext.rope(x, cos, sin, interleaved)
    pairs = (lambda t: t[..., :24].unflatten(-1, (12, 2))) if interleaved else (
        lambda t: torch.stack((t[..., :12], t[..., 12:24]), -1))
    torch.testing.assert_close(pairs(y).norm(dim=-1), pairs(x).norm(dim=-1))
    torch.testing.assert_close(relpos_ext.rope(y, cos, sin, interleaved, inverse=True), x,
                               atol=1e-5, rtol=1e-5)
    # relative: q_i . k_j depends on i - j only
    q, k = torch.randn(32), torch.randn(32)
    rq = relpos_ext.rope(q.expand(50, 32), cos, sin, interleaved)
    rk = relpos_ext.rope(k.expand(50, 32), cos, sin, interleaved)
    dots = rq @ rk.T
    torch.testing.assert_close(dots.diagonal(5), dots.diagonal(5)[:1].expand(45), atol=1e-4,
                               rtol=1e-4)


def test_rope_under_autocast(cpu_isa):
    # bfloat16 projections with float32 tables: the tables are cast, the gradients stay float32
    proj = torch.nn.Linear(16, 32)
    x = torch.randn(2, 6, 16)
    inv_freq, _ = relpos_ext.positions.rope_inv_freq(32)
    cos, sin = relpos_ext.positions.rope_cos_sin(inv_freq, torch.arange(6))
    cos.requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        q = proj(x)
        y = relpos_ext.rope(q, cos, sin)
    assert y.dtype == torch.bfloat16
    y.float().square().sum().backward()
    assert proj.weight.grad.dtype == torch.float32 and cos.grad.dtype == torch.float32
    assert_close(y, ref.rope(q.double(), cos.detach().bfloat16().double(),
                             sin.bfloat16().double()), torch.bfloat16)


# ---------------------------------------------------------------------------------- autograd
ROPE_GRAD_SHAPES = [((2, 3, 4, 10), (2, 1, 4, 6)), ((3, 5, 4), (4,))]


def _check_rope_autograd(device, interleaved, inverse, shapes):
    """gradcheck, gradgradcheck and forward mode of rope in float64 on `device`; returns the
    float64 inputs."""
    xs, cs = shapes
    t = lambda s: torch.randn(s, dtype=torch.float64, device=device,  # noqa: E731
                              requires_grad=True)
    x, cos, sin = t(xs), t(cs), t(cs)
    fn = lambda a, c, s: relpos_ext.rope(a, c, s, interleaved, inverse)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, cos, sin))
    assert torch.autograd.gradgradcheck(fn, (x, cos, sin))
    assert torch.autograd.gradcheck(fn, (x, cos, sin), check_forward_ad=True,
                                    check_backward_ad=False, check_undefined_grad=False)
    return x, cos, sin


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("inverse", [False, True])
def test_rope_batched_gradients(interleaved, inverse):
    """autograd.grad(is_grads_batched=True), five upstream gradients at once, gives the five
    gradients one at a time (x's and the tables'), for each variant."""
    t = lambda *s: torch.randn(*s, dtype=torch.float64, requires_grad=True)  # noqa: E731
    x, cos, sin = t(2, 3, 6), t(3, 4), t(3, 4)
    y = relpos_ext.rope(x, cos, sin, interleaved, inverse)
    ups = torch.randn(5, *y.shape, dtype=torch.float64)
    got = torch.autograd.grad(y, (x, cos, sin), ups, is_grads_batched=True, retain_graph=True)
    one_by_one = [torch.autograd.grad(y, (x, cos, sin), u, retain_graph=True) for u in ups]
    for g, want in zip(got, zip(*one_by_one)):
        torch.testing.assert_close(g, torch.stack(want))


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("shapes", ROPE_GRAD_SHAPES)
def test_rope_gradcheck(cpu_isa, interleaved, inverse, shapes):
    _check_rope_autograd("cpu", interleaved, inverse, shapes)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("shapes", ROPE_GRAD_SHAPES)
def test_rope_autograd_cuda(interleaved, inverse, shapes):
    """On a GPU (scripts/gpu_check.sh runs it): the CUDA kernel's gradients by gradcheck,
    gradgradcheck and forward mode in float64, and opcheck on CUDA tensors."""
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    x, cos, sin = _check_rope_autograd("cuda", interleaved, inverse, shapes)
    torch.library.opcheck(torch.ops.relpos.rope.default,
                          (x.float(), cos.float(), sin.float(), interleaved, inverse))


def test_rope_grads_match_reference_in_low_precision(cpu_isa):
    x = torch.randn(2, 4, 9, 32, dtype=torch.bfloat16, requires_grad=True)
    cos = torch.randn(2, 1, 9, 32, requires_grad=True)  # float32 tables, bfloat16 queries
    sin = torch.randn(2, 1, 9, 32, requires_grad=True)
    g = torch.randn(2, 4, 9, 32, dtype=torch.bfloat16)
    got = torch.autograd.grad(relpos_ext.rope(x, cos, sin), (x, cos, sin), g)
    x64, c64, s64 = (t.detach().double().requires_grad_() for t in (x, cos, sin))
    y64 = ref.rope(x64, c64.bfloat16().double(), s64.bfloat16().double())
    want = torch.autograd.grad(y64, (x64, c64, s64), g.double())
    assert [t.dtype for t in got] == [torch.bfloat16, torch.float32, torch.float32]
    assert_close(got[0], want[0], torch.bfloat16)
    for a, b in zip(got[1:], want[1:]):  # sums of 4 heads' bfloat16 products
        torch.testing.assert_close(a.double(), b, atol=3e-2, rtol=3e-2)


def test_rope_per_sample_grads_by_vmap(cpu_isa):
    x = torch.randn(5, 2, 7, 16)
    cos, sin = _tables((7, 12), torch.float32)
    w = torch.randn(2, 7, 16)

    def loss(xi, c, s):
        return (relpos_ext.rope(xi, c, s) * w).sum()

    got = torch.func.vmap(torch.func.grad(loss, argnums=(0, 1, 2)), in_dims=(0, None, None))(
        x, cos, sin)
    for n in range(5):
        want = torch.func.grad(lambda a, c, s: (ref.rope(a, c, s) * w).sum(), argnums=(0, 1, 2))(
            x[n], cos, sin)
        for a, b in zip(got, want):
            torch.testing.assert_close(a[n], b, atol=1e-5, rtol=1e-5)
    # batched tables and a 4-D x: the samples fold into x's first dim
    cs = torch.randn(3, 2, 1, 7, 16)
    xb = torch.randn(3, 2, 4, 7, 16)
    out = torch.vmap(relpos_ext.rope)(xb, cs, cs.flip(0))
    for n in range(3):
        torch.testing.assert_close(out[n], ref.rope(xb[n], cs[n], cs.flip(0)[n]))


def test_rope_jvp_matches_reference(cpu_isa):
    x, cos, sin = torch.randn(2, 3, 6, 20), torch.randn(6, 12), torch.randn(6, 12)
    tangents = torch.randn_like(x), torch.randn_like(cos), torch.randn_like(sin)
    fn = lambda a, c, s: relpos_ext.rope(a, c, s, True)  # noqa: E731
    _, got = torch.func.jvp(fn, (x, cos, sin), tangents)
    _, want = torch.func.jvp(lambda a, c, s: ref.rope(a, c, s, True), (x, cos, sin), tangents)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("requires_grad", [False, True])
def test_rope_opcheck(cpu_isa, requires_grad):
    t = lambda *s: torch.randn(*s, requires_grad=requires_grad)  # noqa: E731
    for args in [(t(2, 3, 5, 16), t(5, 16), t(5, 16), False, False),
                 (t(2, 5, 3, 16), t(2, 5, 1, 8), t(2, 5, 1, 8), True, True),
                 (t(4, 10), t(4, 6), t(4, 6), False, True)]:
        torch.library.opcheck(torch.ops.relpos.rope.default, args)


def test_rope_compile_fullgraph_dynamic(cpu_isa):
    torch._dynamo.reset()
    inv_freq, _ = relpos_ext.positions.rope_inv_freq(16)

    def f(q, k, positions):
        cos, sin = relpos_ext.positions.rope_cos_sin(inv_freq, positions)
        cos, sin = cos[:, None], sin[:, None]
        return relpos_ext.rope(q, cos, sin), relpos_ext.rope(k, cos, sin)

    compiled = torch.compile(f, fullgraph=True, dynamic=True)
    for length in (5, 9, 14):
        q = torch.randn(2, 4, length, 16, requires_grad=True)
        k = torch.randn(2, 2, length, 16, requires_grad=True)
        positions = torch.arange(length).expand(2, length) + torch.tensor([[0], [3]])
        got, want = compiled(q, k, positions), f(q, k, positions)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)
        g_got = torch.autograd.grad(sum(t.square().sum() for t in got), (q, k))
        g_want = torch.autograd.grad(sum(t.square().sum() for t in want), (q, k))
        for a, b in zip(g_got, g_want):
            torch.testing.assert_close(a, b)


# ------------------------------------------------------------------------------------ errors
@pytest.mark.parametrize("xs,cs,ss,message", [
    ((2, 3, 4, 8), (4, 5), (4, 5), "must be even"),
    ((2, 3, 4, 8), (4, 10), (4, 10), "at most"),
    ((2, 3, 4, 8), (4, 8), (4, 6), "the same shape"),
    ((2, 3, 4, 8), (3, 8), (3, 8), "do not broadcast"),
    ((2, 3, 4, 8), (3, 1, 4, 8), (3, 1, 4, 8), "do not broadcast"),
    ((1, 2, 3, 4, 8), (4, 8), (4, 8), "1 to 4 dims"),
    ((4, 8), (1, 4, 8), (1, 4, 8), "dims"),
])
def test_rope_bad_shapes(backend, xs, cs, ss, message):
    x, cos, sin = torch.randn(xs), torch.randn(cs), torch.randn(ss)
    with pytest.raises(RuntimeError, match=message):
        backend.op("rope")(backend.tensor(x), backend.tensor(cos), backend.tensor(sin), False,
                           False)


def test_rope_bad_dtypes(backend):
    x, cos = torch.randn(2, 4, 8), torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="x must be float32"):
        backend.op("rope")(backend.tensor(x.int()), backend.tensor(cos), backend.tensor(cos),
                           False, False)
    with pytest.raises(RuntimeError, match="sin must be float32"):
        backend.op("rope")(backend.tensor(x), backend.tensor(cos), backend.tensor(cos.long()),
                           False, False)


# ------------------------------------------------------------------- transformers compatibility
def _transformers():
    if os.environ.get("RELPOS_REQUIRE_TRANSFORMERS") == "1":  # CI: a missing package is a failure
        import transformers
        return transformers
    return pytest.importorskip("transformers")


ROPE_CONFIGS = [
    {"rope_type": "default"},
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
     "beta_fast": 16.0, "mscale": 0.7, "mscale_all_dim": 0.9, "truncate": False},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    # LongRoPE (Phi-3): factor from max_position_embeddings / original; long or short factors
    # by seq_len (None: short)
    {"rope_type": "longrope", "original_max_position_embeddings": 32,
     "long_factor": [1.0 + i / 4 for i in range(16)], "short_factor": [1.0 + i / 32 for i in range(16)]},
    {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 32},  # 128 / 32
]


def _factors(params: dict, dim: int) -> dict:
    """``params`` with LongRoPE's per-frequency factors cut to ``dim // 2`` entries."""
    return {k: (v[: dim // 2] if k.endswith("_factor") and isinstance(v, list) else v)
            for k, v in params.items()}


@pytest.mark.parametrize("params", ROPE_CONFIGS,
                         ids=lambda p: "-".join(str(v) for v in p.values() if not isinstance(v, list)))
@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_rope_matches_transformers_llama_neox(cpu_isa, params, partial):
    # the rotary embedding module and apply_rotary_pos_emb of Llama (models/llama/
    # modeling_llama.py) and, for partial rotary, GPT-NeoX (models/gpt_neox/modeling_gpt_neox.py)
    _transformers()
    from transformers import GPTNeoXConfig, LlamaConfig
    from transformers.models.gpt_neox import modeling_gpt_neox as neox
    from transformers.models.llama import modeling_llama as llama

    dim = int(32 * partial)
    params = _factors(params, dim)
    rope_parameters = {"rope_theta": 5000.0, "partial_rotary_factor": partial, **params}
    if partial == 1.0:
        model, config = llama, LlamaConfig(hidden_size=128, num_attention_heads=4,
                                           max_position_embeddings=128,
                                           rope_parameters=rope_parameters)
        rotary = llama.LlamaRotaryEmbedding(config)
    else:
        model, config = neox, GPTNeoXConfig(hidden_size=128, num_attention_heads=4,
                                            max_position_embeddings=128,
                                            rope_parameters=rope_parameters)
        rotary = neox.GPTNeoXRotaryEmbedding(config)
    # past max_position_embeddings (dynamic) or original_max_position_embeddings (longrope)
    seq_len = 300 if params["rope_type"] in ("dynamic", "longrope") else None
    kwargs = {k: v for k, v in params.items() if k != "rope_type"}
    kwargs.update(max_position_embeddings=128, seq_len=seq_len)
    inv_freq, factor = relpos_ext.positions.rope_inv_freq(dim, 5000.0, params["rope_type"],
                                                          **kwargs)
    if params["rope_type"] == "default":
        want_freq, want_factor = rotary.compute_default_rope_parameters(config)
    else:
        want_freq, want_factor = model.ROPE_INIT_FUNCTIONS[params["rope_type"]](
            config, None, seq_len=seq_len)
    assert torch.equal(inv_freq, want_freq) and factor == want_factor

    positions = torch.stack((torch.arange(40), torch.arange(40) + 250))  # [B, L]
    q, k = torch.randn(2, 4, 40, 32), torch.randn(2, 2, 40, 32)
    cos, sin = relpos_ext.positions.rope_cos_sin(inv_freq, positions, factor)
    if seq_len is None:  # the module's own frequencies are those for short sequences
        want_cos, want_sin = rotary(q, positions)
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    want_q, want_k = model.apply_rotary_pos_emb(q, k, cos, sin)
    got_q, got_k = relpos_ext.hf.apply_rotary_pos_emb(q, k, cos, sin)
    # float32 on the CPU paths: the same roundings as transformers' eager code, bit for bit
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


def test_rope_matches_transformers_gptj_interleaved(cpu_isa):
    # GPT-J: rotate_every_two on [B, L, H, D] keys, partial rotary (models/gptj/modeling_gptj.py)
    _transformers()
    from transformers.models.gptj import modeling_gptj as gptj

    rot = 16
    table = gptj.create_sinusoidal_positions(64, rot)
    positions = torch.tensor([[3, 4, 5, 6, 7], [0, 1, 2, 9, 9]])
    sin_hf, cos_hf = torch.split(table[positions], rot // 2, dim=-1)
    k = torch.randn(2, 5, 4, 24)
    want = torch.cat((gptj.apply_rotary_pos_emb(k[..., :rot], sin_hf, cos_hf), k[..., rot:]), -1)
    inv_freq, _ = relpos_ext.positions.rope_inv_freq(rot)
    cos, sin = relpos_ext.positions.rope_cos_sin(inv_freq, positions, interleaved=True)
    got = relpos_ext.rope(k, cos[:, :, None], sin[:, :, None], interleaved=True)
    assert torch.equal(got, want)


@pytest.mark.parametrize("partial,factor", [(0.25, None), (0.5, 2.0), (1.0, None), (0.0, None)])
def test_rope_matches_transformers_gemma4_proportional(cpu_isa, partial, factor):
    # Gemma 4's global layers: "proportional" frequencies over the whole head dim, zero past the
    # rotated share, and a one-tensor apply_rotary_pos_emb on [B, L, H, D]
    # (models/gemma4/modeling_gemma4.py)
    _transformers()
    from transformers import Gemma4TextConfig
    from transformers.models.gemma4 import modeling_gemma4 as gemma4

    head_dim = 32
    rope = {"rope_type": "proportional", "partial_rotary_factor": partial, "rope_theta": 1e6}
    if factor is not None:
        rope["factor"] = factor
    config = Gemma4TextConfig(hidden_size=64, num_attention_heads=2, head_dim=16,
                              global_head_dim=head_dim, num_hidden_layers=2, vocab_size=64,
                              intermediate_size=64,
                              layer_types=["sliding_attention", "full_attention"],
                              rope_parameters={"sliding_attention": {"rope_type": "default",
                                                                     "rope_theta": 1e4},
                                               "full_attention": rope})
    rotary = gemma4.Gemma4TextRotaryEmbedding(config)
    inv_freq, scale = relpos_ext.positions.rope_inv_freq(
        head_dim, 1e6, "proportional", factor=factor, partial_rotary_factor=partial)
    assert torch.equal(inv_freq, rotary.full_attention_inv_freq)
    assert scale == rotary.full_attention_attention_scaling
    assert int((inv_freq != 0).sum()) == int(partial * head_dim // 2)

    x = torch.randn(2, 40, 2, head_dim)  # [B, L, H, D]
    positions = torch.stack((torch.arange(40), torch.arange(40) + 250))
    cos, sin = relpos_ext.positions.rope_cos_sin(inv_freq, positions, scale)
    want_cos, want_sin = rotary(x, positions, "full_attention")
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    want = gemma4.apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim=2)
    got = relpos_ext.hf.apply_rotary_pos_emb_single(x, cos, sin, unsqueeze_dim=2)
    assert torch.equal(got, want)
    # the zero-frequency pairs pass through unchanged
    still = torch.cat((inv_freq, inv_freq)) == 0
    assert torch.equal(got[..., still], x[..., still])


def test_rope_dynamic_ntk_matches_the_growing_module():
    """Dynamic NTK past max_position_embeddings as transformers' rotary module computes it when
    a sequence grows: its dynamic_rope_update passes seq_len = max(position_ids) + 1 as a 0-d
    int64 tensor, which makes the base a float32 computation (with an int, transformers and we
    compute it in float64, 1.8e-4 apart in cos here). Given that tensor, the frequencies and cos
    and sin are the module's bit for bit; below max_position_embeddings too."""
    _transformers()
    from transformers import LlamaConfig
    from transformers.models.llama import modeling_llama as llama

    dim, theta, factor, mpe = 128, 500000.0, 4.0, 2048
    config = LlamaConfig(hidden_size=dim * 4, num_attention_heads=4, max_position_embeddings=mpe,
                         rope_parameters={"rope_type": "dynamic", "factor": factor,
                                          "rope_theta": theta})
    for length in (5000, 100):
        rotary = llama.LlamaRotaryEmbedding(config)
        pos = torch.arange(length)[None]
        want_cos, want_sin = rotary(torch.zeros(1, 1, length, dim), pos)
        inv_freq, scale = relpos_ext.positions.rope_inv_freq(
            dim, theta, "dynamic", factor=factor, max_position_embeddings=mpe,
            seq_len=pos.max() + 1)
        assert torch.equal(inv_freq, rotary.inv_freq)
        cos, sin = relpos_ext.positions.rope_cos_sin(inv_freq, pos, scale)
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)


def test_rope_yarn_betas_none_take_the_defaults():
    """A config's rope_parameters.get("beta_fast") is None where the entry is missing;
    transformers then takes 32 and 1, and so does rope_inv_freq."""
    kw = dict(factor=4.0, original_max_position_embeddings=64)
    want = relpos_ext.positions.rope_inv_freq(32, 10000.0, "yarn", **kw)
    got = relpos_ext.positions.rope_inv_freq(32, 10000.0, "yarn", beta_fast=None, beta_slow=None,
                                             **kw)
    assert torch.equal(got[0], want[0]) and got[1] == want[1]


@pytest.mark.parametrize("args,kwargs,message", [
    ((7,), {}, "even and positive"),
    ((8, 10000.0, "linear"), {"partial_rotary_factor": 0.5}, "for 'proportional' only"),
    ((8, 10000.0, "proportional"), {"partial_rotary_factor": 1.5}, r"must be in \[0, 1\]"),
    ((8, 10000.0, "ntk"), {}, "rope_type must be one of"),
    ((8, 10000.0, "dynamic"), {"factor": 2.0}, "needs max_position_embeddings"),
    ((8, 10000.0, "yarn"), {"factor": 2.0}, "needs original_max_position_embeddings"),
    ((8, 10000.0, "llama3"), {"factor": 2.0}, "needs original_max_position_embeddings"),
    ((8, 10000.0, "longrope"), {"original_max_position_embeddings": 8, "factor": 2.0,
                                "long_factor": [1.0] * 4}, "needs original_max_position"),
    ((8, 10000.0, "longrope"), {"original_max_position_embeddings": 8, "factor": 2.0,
                                "long_factor": [1.0] * 3, "short_factor": [1.0] * 4},
     "long_factor must have dim // 2 = 4 entries"),
    ((8, 10000.0, "longrope"), {"original_max_position_embeddings": 8, "long_factor": [1.0] * 4,
                                "short_factor": [1.0] * 4}, "needs factor"),
])
def test_rope_inv_freq_bad_arguments(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        relpos_ext.positions.rope_inv_freq(*args, **kwargs)
