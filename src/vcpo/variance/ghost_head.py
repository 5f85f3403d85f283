"""The LM head's share of the fast per-row gradients (vcpo.variance.ghost_norms) without any [tokens, V] tensor
beyond one vocabulary chunk: the log-probs of the response tokens, their gradient into the model body, each row's
squared head-gradient norm and the coefficient-weighted head gradient, all from passes over the vocabulary in chunks.

Notation, for the n response tokens of a row: hidden state ``h_t`` [D] predicts target ``y_t``; logits
``z_t = (W h_t + c) / T`` (head weight W [V, D], bias c, temperature T), ``p_t = softmax(z_t)``,
``lp_t = z_t[y_t] - logsumexp(z_t)``. Then ``d lp_t / d z_t = e_{y_t} - p_t`` and, with ``g_t = (e_{y_t} - p_t) / T``,

    ``grad_W score_b = sum_t g_t h_t^T``,  ``grad_c score_b = sum_t g_t``,  ``grad_h lp_t = W^T g_t``,
    ``||grad_W score_b||^2 = sum_{t,s} (g_t . g_s)(h_t . h_s)``,  ``||grad_c score_b||^2 = sum_{t,s} g_t . g_s``.

Written with ``a_t = 1 - p_t(y_t)`` (from ``-expm1(lp_t)``, exact for confident tokens) and ``q_t`` = p_t with its
target entry zeroed (so ``g_t T = a_t e_{y_t} - q_t``):

    ``T^2 g_t . g_s = a_t a_s [y_t = y_s] - a_t q_s(y_t) - a_s q_t(y_s) + q_t . q_s``

Every term is small when the tokens are confident, so nothing cancels (the expansion through ``p_t . p_s`` would
subtract numbers near 1 and lose a bfloat16 Gram's precision). ``q_t . q_s`` is the only sum over the vocabulary: a
token Gram of the chunk's exponentiated logits, accumulated with the online log-sum-exp's rescaling in the same pass
that computes the log-probs and ``W^T q_t`` (for ``grad_h``). ``q_s(y_t) = exp(z_s[y_t] - lse_s)`` needs only the
[n, n] product of the hidden states with the target rows ``W[y_t]``.

A tied input embedding adds ``sum_s e_{x_s} u_s^T`` to the same weight (``u_s`` its output gradient at position s,
``x_s`` the input id); the cross term of the squared norm is ``2 sum_{t,s} g_t[x_s] (h_t . u_s)`` with
``T g_t[x_s] = [x_s = y_t] a_t - q_t(x_s)``: a gather, no vocabulary sum.

Matrix products run in the weights' dtype (bfloat16 weights: tensor cores, accumulated in float32 inside the
kernel); logits, exponentials and every sum are float32 (float64 for a float64 model).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

CHUNK_LOGITS = 1 << 26
"""Logits per chunk (256 MiB in float32; a pass holds about three such tensors): a block of tokens times a slice of
the vocabulary. Large, so that a batch takes few chunks: each is some thirty kernel launches on a GPU."""
VOCAB_CHUNK_MIN = 4096
"""The narrowest vocabulary slice: a batch too long for all its tokens to share one block of wider slices is cut
into blocks of rows instead."""
VOCAB_CHUNK: int | None = None
"""A fixed vocabulary slice (tests force small ones); None: the widest that fits all rows in one block."""
_HALF = (torch.bfloat16, torch.float16)


@dataclass
class HeadTerm:
    """What the head's per-row gradients are built from, for one batch (rows padded to ``n`` response tokens).

    ``hidden_BnD`` the hidden states that predict the response tokens (detached), ``targets_Bn`` the tokens,
    ``valid_Bn`` which slots are real, ``lse_Bn`` and ``a_Bn`` (``1 - p(target)``) in float32; ``head_sq_B`` and
    ``bias_sq_B`` the rows' squared head-gradient norms where ``has_sq_B`` (computed in the capture's pass)."""

    head: nn.Linear
    hidden_BnD: Tensor
    targets_Bn: Tensor
    valid_Bn: Tensor
    lse_Bn: Tensor
    a_Bn: Tensor
    head_sq_B: Tensor
    bias_sq_B: Tensor
    has_sq_B: Tensor
    temperature: float
    fp32: bool
    part: str = "weight"

    def rows(self, rows: Tensor) -> HeadTerm:
        """The term of the batch rows ``rows`` only."""
        pick = {name: getattr(self, name).index_select(0, rows) for name in (
            "hidden_BnD", "targets_Bn", "valid_Bn", "lse_Bn", "a_Bn", "head_sq_B", "bias_sq_B", "has_sq_B")}
        return HeadTerm(self.head, **pick, temperature=self.temperature, fp32=self.fp32, part=self.part)


def aligned(n: int) -> int:
    """``n`` rounded up to a multiple of 8. A matrix dimension that is not (a row of 383 tokens, a vocabulary slice
    of 10,922) sends cuBLAS to slow unaligned kernels (sm75 cutlass on an H100, 3-6x slower); the extra token
    slots are padding whose gradient is zero, so they change no norm."""
    return -(-n // 8) * 8


_WIDE_OUT: dict[torch.device, bool] = {}


def bmm_widened(a: Tensor, b: Tensor) -> Tensor:
    """``bmm(a, b)`` held in at least float32. Half-precision factors on CUDA give a float32 result from the one
    kernel (cuBLAS accumulates in float32 anyway; ``out_dtype``), saving the rounding and a cast's launch;
    elsewhere the product is rounded to the factors' dtype, then widened."""
    wide = torch.promote_types(a.dtype, torch.float32)
    if a.is_cuda and a.dtype in _HALF:
        if a.device not in _WIDE_OUT:  # out_dtype arrived in torch 2.8 and not on every build: tried once
            try:
                torch.bmm(a[:1, :1], b[:1, :, :1], out_dtype=torch.float32)
                _WIDE_OUT[a.device] = True
            except (RuntimeError, TypeError, NotImplementedError):
                _WIDE_OUT[a.device] = False
        if _WIDE_OUT[a.device]:
            return torch.bmm(a, b, out_dtype=torch.float32)
    return torch.bmm(a, b).to(wide)


def _compute_dtype(head: nn.Linear, fp32: bool) -> torch.dtype:
    return torch.float32 if fp32 and head.weight.dtype in _HALF else head.weight.dtype


def _acc_dtype(head: nn.Linear) -> torch.dtype:
    """Logits, exponentials and sums: float32, or the weights' dtype when wider (float64 models stay float64)."""
    return torch.promote_types(head.weight.dtype, torch.float32)


def _logits(head: nn.Linear, hidden: Tensor, v0: int, v1: int, compute: torch.dtype, temperature: float) -> Tensor:
    """float32 ``z = (W[v0:v1] h + c[v0:v1]) / T`` of a block of tokens: the product in ``compute`` (its output
    rounded as the model's own head would round it), then float32, as vcpo.variance.logprobs' lean path does."""
    bias = None if head.bias is None else head.bias[v0:v1].detach().to(compute)
    z = F.linear(hidden.to(compute), head.weight[v0:v1].detach().to(compute), bias).to(_acc_dtype(head))
    return z / temperature if temperature != 1.0 else z


def _token_blocks(n_rows: int, n: int, vocab: int) -> tuple[int, int]:
    """(rows per block, vocabulary slice) with rows x n x slice <= CHUNK_LOGITS (or one row and the narrowest
    slice): all rows in one block where the slice can stay at least ``VOCAB_CHUNK_MIN`` wide, since the number of
    (block, slice) passes, some thirty launches each, is what a GPU pays for."""
    widest = max(VOCAB_CHUNK_MIN, CHUNK_LOGITS // max(1, n_rows * n)) // 128 * 128  # aligned: see ``aligned``
    v_chunk = min(vocab, VOCAB_CHUNK or widest)
    return max(1, min(n_rows, CHUNK_LOGITS // max(1, n * v_chunk))), v_chunk


def _target_slot(targets_bn: Tensor, v0: int, v1: int) -> tuple[Tensor, Tensor]:
    """``(in_chunk_bn, idx_bn1)``: whether each token's target falls in the vocabulary slice ``[v0, v1)``, and its
    index there (clamped when it does not)."""
    return (targets_bn >= v0) & (targets_bn < v1), (targets_bn - v0).clamp(0, v1 - v0 - 1)[..., None]


def _zero_targets(x_bnV: Tensor, in_chunk_bn: Tensor, idx_bn1: Tensor) -> None:
    """Zero, in place, each token's target entry in a slice of the vocabulary (where it falls there)."""
    x_bnV.scatter_(-1, idx_bn1, x_bnV.gather(-1, idx_bn1) * (~in_chunk_bn)[..., None])


def _head_pass(
    head: nn.Linear, hidden_bnD: Tensor, targets_bn: Tensor, temperature: float, compute: torch.dtype,
    want_grad_h: bool, want_gram: bool,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None, Tensor]:
    """One online pass over the vocabulary for a block of rows: ``(lse, z[target], W^T q (x l), q . q Gram (x l l),
    l)`` with ``l = sum_v exp(z_v - m)`` at the final running max m, so that ``p_v = exp(z_v - m) / l``. Padded
    slots get values too (from zero hidden states): their rows of the last two are not zeroed here."""
    b, n, _ = hidden_bnD.shape
    vocab = head.out_features
    dev, acc = hidden_bnD.device, _acc_dtype(head)
    m = torch.full((b, n), -math.inf, dtype=acc, device=dev)
    l_bn = torch.zeros(b, n, dtype=acc, device=dev)
    z_target = torch.zeros(b, n, dtype=acc, device=dev)
    o_bnD = torch.zeros(b, n, head.in_features, dtype=acc, device=dev) if want_grad_h else None
    gram_bnn = torch.zeros(b, n, n, dtype=acc, device=dev) if want_gram else None
    _, v_chunk = _token_blocks(b, n, vocab)
    for v0 in range(0, vocab, v_chunk):
        v1 = min(vocab, v0 + v_chunk)
        z = _logits(head, hidden_bnD, v0, v1, compute, temperature)
        in_chunk, idx = _target_slot(targets_bn, v0, v1)
        z_target = torch.where(in_chunk, z.gather(-1, idx).squeeze(-1), z_target)
        m_new = torch.maximum(m, z.amax(-1))
        alpha = torch.exp(m - m_new)  # 0 on the first chunk (m = -inf)
        e = torch.exp(z.sub_(m_new[..., None]))  # in place: z is this chunk's own tensor
        l_bn = l_bn * alpha + e.sum(-1)
        m = m_new
        if o_bnD is None and gram_bnn is None:
            continue
        _zero_targets(e, in_chunk, idx)  # q (padded slots are zeroed after the pass, by whoever reads them)
        e_c = e.to(compute)
        if o_bnD is not None:
            o_bnD.mul_(alpha[..., None]).add_(torch.matmul(e_c, head.weight[v0:v1].detach().to(compute)).to(acc))
        if gram_bnn is not None:
            gram_bnn.mul_(alpha[:, :, None] * alpha[:, None, :]).add_(bmm_widened(e_c, e_c.transpose(1, 2)).to(acc))
    lse = m + torch.log(l_bn)
    return lse, z_target, o_bnD, gram_bnn, l_bn


def _target_logits(head: nn.Linear, hidden_bnD: Tensor, targets_bn: Tensor, compute: torch.dtype,
                   temperature: float) -> Tensor:
    """[b, n, n] ``z_s[y_t]``: each token's logit at every target of its row (rows s, columns t)."""
    acc = _acc_dtype(head)
    w_bnD = head.weight.detach()[targets_bn].to(compute)
    z = torch.bmm(hidden_bnD.to(compute), w_bnD.transpose(1, 2)).to(acc)
    if head.bias is not None:
        z = z + head.bias.detach()[targets_bn].to(acc)[:, None, :]
    return z / temperature if temperature != 1.0 else z


def _gg(term_tensors: tuple[Tensor, ...], gram_bnn: Tensor, l_bn: Tensor, z_st: Tensor, temperature: float) -> Tensor:
    """[b, n, n] ``g_t . g_s`` (module docstring) from the pass's Gram and the target logits."""
    targets, valid, lse, a = term_tensors
    vf = valid.to(gram_bnn.dtype)
    same = (targets[:, :, None] == targets[:, None, :]).to(gram_bnn.dtype)
    # q_s(y_t): p_s(y_t) unless y_t is s's own target (zeroed in q_s)
    q_at = torch.exp(z_st - lse[:, :, None]) * (1.0 - same)
    q_dot = gram_bnn / (l_bn[:, :, None] * l_bn[:, None, :]).clamp_min(1e-30)
    gg = a[:, :, None] * a[:, None, :] * same - q_at * a[:, None, :] - (q_at * a[:, None, :]).transpose(1, 2) + q_dot
    return gg * (vf[:, :, None] * vf[:, None, :]) / temperature**2


def _row_head_sq(head: nn.Linear, hidden_bnD: Tensor, term_tensors: tuple[Tensor, ...], gram_bnn: Tensor,
                 l_bn: Tensor, compute: torch.dtype, temperature: float) -> tuple[Tensor, Tensor]:
    """Per row of a block, from its pass's Gram: ``sum_{t,s} (g_t . g_s)(h_t . h_s)`` (weight) and
    ``sum_{t,s} g_t . g_s`` (bias); ``term_tensors`` are the block's (targets, valid, lse, a)."""
    z_st = _target_logits(head, hidden_bnD, term_tensors[0], compute, temperature)
    gg_bnn = _gg(term_tensors, gram_bnn, l_bn, z_st, temperature)
    h = hidden_bnD.to(compute)
    hh = torch.bmm(h, h.transpose(1, 2)).to(gg_bnn.dtype)
    return (gg_bnn * hh).sum((1, 2)), gg_bnn.sum((1, 2))


def head_sq_norms(term: HeadTerm, rows: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """([B] float32 squared norms of the head weight's per-row gradients, of its bias's), from the capture's pass
    where it computed them, by another pass over the vocabulary for the rows ``rows`` it did not."""
    need = ~term.has_sq_B if rows is None else (~term.has_sq_B).index_select(0, rows)
    if bool(need.any()):
        missing = need.nonzero().squeeze(1) if rows is None else rows[need]
        weight_sq, bias_sq = _block_norms(term, missing)
        term.head_sq_B[missing], term.bias_sq_B[missing] = weight_sq, bias_sq
        term.has_sq_B[missing] = True
    pick = (lambda t: t) if rows is None else (lambda t: t.index_select(0, rows))
    return pick(term.head_sq_B), pick(term.bias_sq_B)


def _block_norms(term: HeadTerm, rows: Tensor) -> tuple[Tensor, Tensor]:
    compute = _compute_dtype(term.head, term.fp32)
    n = term.hidden_BnD.shape[1]
    per_block, _ = _token_blocks(len(rows), n, term.head.out_features)
    weight_sq, bias_sq = [], []
    for start in range(0, len(rows), per_block):
        r = rows[start : start + per_block]
        h, targets = term.hidden_BnD[r], term.targets_Bn[r]
        lse, _, _, gram, l_bn = _head_pass(term.head, h, targets, term.temperature, compute, False, True)
        w, b = _row_head_sq(term.head, h, (targets, term.valid_Bn[r], lse, term.a_Bn[r]), gram, l_bn, compute,
                            term.temperature)
        weight_sq.append(w)
        bias_sq.append(b)
    return torch.cat(weight_sq), torch.cat(bias_sq)


def tied_cross(term: HeadTerm, ids_BS: Tensor, grad_BSD: Tensor) -> Tensor:
    """[B] ``2 <grad_W head_b, grad_W embedding_b>`` of a head tied to the input embedding: ``ids_BS`` the input ids
    and ``grad_BSD`` the embedding's output gradients (vcpo.variance.ghost_layers' embedding term)."""
    compute, acc = _compute_dtype(term.head, term.fp32), _acc_dtype(term.head)
    h = term.hidden_BnD.to(compute)
    w_x = term.head.weight.detach()[ids_BS].to(compute)  # [B, S, D]: W[x_s]
    z_tx = torch.bmm(h, w_x.transpose(1, 2)).to(acc)  # [B, n, S]: h_t . W[x_s]
    if term.head.bias is not None:
        z_tx = z_tx + term.head.bias.detach()[ids_BS].to(acc)[:, None, :]
    if term.temperature != 1.0:
        z_tx = z_tx / term.temperature
    hit = term.targets_Bn[:, :, None] == ids_BS[:, None, :]
    g_tx = torch.where(hit, term.a_Bn[:, :, None], -torch.exp(z_tx - term.lse_Bn[:, :, None]))
    g_tx = g_tx * term.valid_Bn[:, :, None].to(acc) / term.temperature
    hu = torch.bmm(h, grad_BSD.to(compute).transpose(1, 2)).to(acc)  # [B, n, S]: h_t . u_s
    return 2.0 * (g_tx * hu).sum((1, 2))


def head_weighted_grads(term: HeadTerm, coef_B: Tensor, want_bias: bool) -> tuple[Tensor, Tensor | None]:
    """``sum_b coef_b grad score_b`` of the head's weight (and bias): ``(1/T)(sum_t c_t a_t e_{y_t} h_t^T - Q^T
    (c h))``, one pass over the vocabulary recomputing the logits, each slice of the weight's gradient written once,
    in the weight's dtype."""
    head, compute, acc = term.head, _compute_dtype(term.head, term.fp32), _acc_dtype(term.head)
    B, n, D = term.hidden_BnD.shape
    vocab = head.out_features
    c_Bn = coef_B.to(acc)[:, None] * term.valid_Bn.to(acc) / term.temperature  # c_t / T, 0 at padded slots
    ch = (c_Bn[..., None] * term.hidden_BnD.to(acc)).to(compute)  # [B, n, D]: c_t h_t / T
    targets = term.targets_Bn[term.valid_Bn]
    hit = (c_Bn * term.a_Bn)[term.valid_Bn]  # c_t a_t / T at each real slot
    hit_ND = hit[:, None] * term.hidden_BnD[term.valid_Bn].to(acc)  # its row of the weight's gradient
    grad_w = torch.empty(vocab, D, dtype=head.weight.dtype, device=ch.device)
    grad_b = torch.zeros(vocab, dtype=acc, device=ch.device) if want_bias else None
    per_block, v_chunk = _token_blocks(B, n, vocab)
    for v0 in range(0, vocab, v_chunk):
        v1 = min(vocab, v0 + v_chunk)
        grad_c = torch.zeros(v1 - v0, D, dtype=acc, device=ch.device)
        for r0 in range(0, B, per_block):
            r1 = min(B, r0 + per_block)
            z = _logits(head, term.hidden_BnD[r0:r1], v0, v1, compute, term.temperature)
            q = torch.exp(z.sub_(term.lse_Bn[r0:r1, :, None]))
            _zero_targets(q, *_target_slot(term.targets_Bn[r0:r1], v0, v1))
            grad_c -= (q.to(compute).reshape(-1, v1 - v0).T @ ch[r0:r1].reshape(-1, D)).to(acc)
            if grad_b is not None:
                grad_b[v0:v1] -= (q * c_Bn[r0:r1, :, None]).sum((0, 1))
        in_chunk = (targets >= v0) & (targets < v1)
        grad_c.index_add_(0, targets[in_chunk] - v0, hit_ND[in_chunk])
        grad_w[v0:v1] = grad_c.to(grad_w.dtype)
    if grad_b is not None:
        grad_b.index_add_(0, targets, hit)
        grad_b = grad_b.to(head.bias.dtype)
    return grad_w, grad_b


class _HeadScore(torch.autograd.Function):
    """``lp`` of the response tokens from their hidden states [N, D]; the backward is ``grad_lp_t W^T g_t`` from
    what the forward's pass kept (``W^T g_t``, [N, D]), so the capture's backward recomputes no logits. The head's
    weight enters detached: its per-row gradients are the ``HeadTerm``'s, not autograd's."""

    @staticmethod
    def forward(ctx, hidden_ND, head, slot_rows_N, slot_cols_N, n_rows, n, targets_N, temperature, fp32, gram_B,
                out):
        compute, acc = _compute_dtype(head, fp32), _acc_dtype(head)
        D, dev = hidden_ND.shape[1], hidden_ND.device
        hidden_BnD = hidden_ND.new_zeros(n_rows, n, D)
        hidden_BnD[slot_rows_N, slot_cols_N] = hidden_ND.detach()
        targets_Bn = torch.zeros(n_rows, n, dtype=torch.long, device=dev)
        targets_Bn[slot_rows_N, slot_cols_N] = targets_N
        valid_Bn = torch.zeros(n_rows, n, dtype=torch.bool, device=dev)
        valid_Bn[slot_rows_N, slot_cols_N] = True
        lse_Bn = torch.zeros(n_rows, n, dtype=acc, device=dev)
        lp_Bn = torch.zeros(n_rows, n, dtype=acc, device=dev)
        a_Bn = torch.zeros(n_rows, n, dtype=acc, device=dev)
        gh_BnD = hidden_ND.new_zeros(n_rows, n, D)
        head_sq = torch.zeros(n_rows, dtype=acc, device=dev)
        bias_sq = torch.zeros(n_rows, dtype=acc, device=dev)
        per_block, _ = _token_blocks(n_rows, n, head.out_features)
        w = head.weight.detach()
        for r0 in range(0, n_rows, per_block):
            r1 = min(n_rows, r0 + per_block)
            h, t, v = hidden_BnD[r0:r1], targets_Bn[r0:r1], valid_Bn[r0:r1]
            gram_rows = gram_B[r0:r1]
            want_gram = bool(gram_rows.any())
            lse, z_t, o_bnD, gram, l_bn = _head_pass(head, h, t, temperature, compute, True, want_gram)
            lp = (z_t - lse) * v
            a = -torch.expm1(lp)
            lse_Bn[r0:r1], lp_Bn[r0:r1], a_Bn[r0:r1] = lse, lp, a
            # grad_h lp_t = W^T g_t = (a_t W[y_t] - W^T q_t) / T
            gh = (a[..., None] * w[t].to(acc) - o_bnD / l_bn[..., None]) * v[..., None].to(acc)
            gh_BnD[r0:r1] = (gh / temperature).to(gh_BnD.dtype)
            if want_gram:
                head_sq[r0:r1], bias_sq[r0:r1] = _row_head_sq(head, h, (t, v, lse, a), gram, l_bn, compute, temperature)
        out.append(HeadTerm(head, hidden_BnD, targets_Bn, valid_Bn, lse_Bn, a_Bn, head_sq, bias_sq, gram_B.clone(),
                            temperature, fp32))
        ctx.save_for_backward(gh_BnD, slot_rows_N, slot_cols_N)
        return lp_Bn[slot_rows_N, slot_cols_N]

    @staticmethod
    def backward(ctx, grad_lp_N):
        gh_BnD, slot_rows_N, slot_cols_N = ctx.saved_tensors
        grad_hidden = grad_lp_N[:, None].to(gh_BnD.dtype) * gh_BnD[slot_rows_N, slot_cols_N]
        return grad_hidden, None, None, None, None, None, None, None, None, None, None


def head_capture(
    head: nn.Linear, hidden_BSD: Tensor, input_ids: Tensor, response_mask: Tensor, temperature: float, fp32: bool,
    gram_B: Tensor | None,
) -> tuple[Tensor, HeadTerm]:
    """``(lp_BS, term)``: the [B, S] log-probs of the response tokens (0 elsewhere; differentiable into
    ``hidden_BSD`` through ``grad_h``) and the head's ``HeadTerm``, whose squared norms cover the rows ``gram_B``
    (a [B] bool mask; None: all rows, and none when the head is frozen)."""
    B, S = input_ids.shape
    rows, cols = response_mask[:, 1:].bool().nonzero(as_tuple=True)  # token cols + 1 is predicted at cols
    counts = torch.bincount(rows, minlength=B)
    n = int(counts.max()) if rows.numel() else 0
    starts = torch.cumsum(counts, 0) - counts
    slots = torch.arange(rows.numel(), device=rows.device) - starts[rows]
    trainable = head.weight.requires_grad or (head.bias is not None and head.bias.requires_grad)
    if gram_B is None:
        gram_B = torch.full((B,), trainable, dtype=torch.bool, device=input_ids.device)
    out: list[HeadTerm] = []
    lp_N = _HeadScore.apply(hidden_BSD[rows, cols], head, rows, slots, B, aligned(max(n, 1)), input_ids[rows, cols + 1],
                            temperature, fp32, gram_B & trainable, out)
    lp_BS = lp_N.new_zeros(B, S).index_put((rows, cols + 1), lp_N)
    return lp_BS, out[0]
