"""Per-layer algebra of the fast per-row gradients: what one call of a supported module contributes to each row's
gradient of its parameters, the squared norms of those per-row gradients and their coefficient-weighted sum.

Costs, per row of n gradient-carrying tokens (positions up to its last response token; the rest of a padded row
is trimmed away, rows of similar lengths chunked together) and a weight of R x C:
- token Gram ``sum_{n,m} (l_n . l_m)(r_n . r_m)``: 2 n^2 (R + C) flops, [n, n] Grams, products in the factors'
  dtype (bfloat16 factors: tensor cores, float32 accumulation), held and summed in float32;
- materialised ``sum_n l_n r_n^T``: 2 n R C flops, a [R, C] product per row in the factors' dtype, squared and
  summed in float32;
whichever is cheaper (``prefer_gram``). The LM head's weight never goes through either: vcpo.variance.ghost_head.
"""

from __future__ import annotations

import weakref
from collections import Counter
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vcpo.variance.ghost_head import (
    HeadTerm,
    aligned,
    bmm_widened,
    head_sq_norms,
    head_weighted_grads,
    tied_cross,
)

# Per-row-chunk working-set bound (elements) for token Grams and materialised per-row gradients.
_CHUNK_ELEMENTS = 1 << 24


@dataclass
class MatrixTerm:
    """One module call's share of a 2-D weight's per-row gradient: ``grad_b = sum_n left[b, n] (outer) right[b, n]``.

    ``left`` is dense [B, N, rows of the weight] or, for an embedding, the [B, N] long row index whose one-hot
    vector it stands for; ``right_BNC`` is dense [B, N, columns of the weight].
    """

    left: Tensor
    right_BNC: Tensor


@dataclass
class VectorTerm:
    """One module call's per-row gradient of a parameter that is cheap to hold per row (bias, norm weight)."""

    grad_BP: Tensor


Term = MatrixTerm | VectorTerm | HeadTerm


@dataclass(frozen=True)
class RowChunk:
    """Rows ``rows`` of the batch whose gradient-carrying tokens all lie in the first ``n`` positions."""

    rows: slice
    n: int


def row_chunks(lengths: list[int], per_row: int | None, max_ratio: float = 2.0) -> list[RowChunk]:
    """Consecutive rows grouped so that each group's working set stays under ``_CHUNK_ELEMENTS``: ``per_row``
    elements a row (None: a token Gram, ``n^2`` for the group's longest row n); a row shorter than the group's
    longest by more than ``max_ratio`` starts a new group (the learner sorts rows by length). Each group is a few
    kernel launches per weight, so groups are split only where trimming saves much: a GPU step of a 0.5B model is
    bound by its launches as much as by its FLOPs."""
    chunks, start, longest = [], 0, 0
    for i, n in enumerate(lengths):
        grown = max(longest, n, 1)
        size = (i - start + 1) * (per_row if per_row is not None else grown * grown)
        if i > start and (size > _CHUNK_ELEMENTS or grown > max_ratio * max(n, 1)):
            chunks.append(RowChunk(slice(start, i), longest))
            start, grown = i, max(n, 1)
        longest = grown
    if lengths:
        chunks.append(RowChunk(slice(start, len(lengths)), longest))
    return chunks


def module_kind(module: nn.Module) -> str | None:
    """The name of the per-row gradient rule that fits ``module``'s own parameters, or None if none does."""
    kind = type(module)
    if kind is nn.Linear:
        return "linear"
    if kind is nn.Embedding:
        return None if module.max_norm is not None or module.scale_grad_by_freq else "embedding"
    if kind is nn.LayerNorm:
        return "layer_norm"
    if kind is nn.RMSNorm:
        return "rms_norm"
    if kind.__name__ == "Conv1D" and kind.__module__ == "transformers.pytorch_utils":
        return "conv1d"
    # Hugging Face decoders each define their own RMSNorm class (Qwen2RMSNorm, LlamaRMSNorm, ...);
    # save_activation checks on every call that the output really is weight * x_hat.
    own = dict(module.named_parameters(recurse=False))
    if kind.__name__.endswith("RMSNorm") and set(own) == {"weight"} and own["weight"].dim() == 1:
        if isinstance(getattr(module, "variance_epsilon", getattr(module, "eps", None)), float):
            return "hf_rms_norm"
    return None


@dataclass
class ScaledOutput:
    """A norm's x_hat kept as ``output / scale`` without materialising it: the per-row weight gradient
    ``sum_n g_n * x_hat_n`` is ``(sum_n g_n * output_n) / scale``, one division per row instead of per token."""

    output: Tensor
    scale: Tensor

    @property
    def _version(self) -> int:
        return self.output._version


# The form each Hugging Face RMSNorm module was verified to compute: False for w * x_hat, True for (1 + w) * x_hat.
_RMS_FORMS: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()


def _hf_rms_saved(module: nn.Module, x: Tensor, output: Tensor) -> Tensor | ScaledOutput:
    """x_hat of a Hugging Face RMSNorm (float32 statistics, cast back), verified against the module's own output.

    The formula is the class's, not the data's, so it is checked on the first row of the module's first call
    only (the check costs more than the rest); then x_hat is the output over the scale (nothing recomputed)
    unless the scale has an entry near zero or the output is half precision, where x_hat is recomputed.
    """
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))

    def recompute(x: Tensor) -> Tensor:  # float32 statistics, as the module computes them; one fused kernel
        return F.rms_norm(x.to(torch.float32), x.shape[-1:], eps=eps).to(x.dtype)

    def scale_of(plus_one: bool) -> Tensor:
        return 1.0 + module.weight.float() if plus_one else module.weight

    if module not in _RMS_FORMS:
        x_hat_row = recompute(x[:1])
        tol = {torch.float64: 1e-10, torch.float32: 1e-5}.get(output.dtype, 2e-2)
        # y = w * x_hat (Qwen2, Llama) and y = (1 + w) * x_hat (Gemma) share dy/dw = x_hat; anything else is refused.
        for plus_one in (False, True):
            if torch.allclose(output[:1], (scale_of(plus_one) * x_hat_row).to(output.dtype), rtol=tol, atol=tol):
                _RMS_FORMS[module] = plus_one
                break
        else:
            raise NotImplementedError(
                f"{type(module).__name__} is not y = weight * rms_normalised(x); fast grad norms cannot handle it"
            )
    # A copy, not a view: a sharded model (FSDP2) frees the gathered weight when the layer's forward ends.
    scale = scale_of(_RMS_FORMS[module]).detach().clone()
    # A near-zero scale entry (or a flushed denormal product) cannot be divided back out.
    if output.dtype in (torch.float32, torch.float64) and float(scale.abs().min()) > 1e-6:
        return ScaledOutput(output.detach(), scale.to(output.dtype))
    return recompute(x)


def save_activation(kind: str, module: nn.Module, x: Tensor, output: Tensor) -> Tensor | ScaledOutput:
    """What the per-row gradient rule of ``kind`` needs from the forward: the input, or the normalised input."""
    with torch.no_grad():
        if kind == "layer_norm":
            return F.layer_norm(x, module.normalized_shape, eps=module.eps)
        if kind == "rms_norm":
            return F.rms_norm(x, module.normalized_shape, eps=module.eps)
        if kind == "hf_rms_norm":
            return _hf_rms_saved(module, x, output)
    return x.detach()


def _compute_dtype(*tensors: Tensor) -> torch.dtype:
    """At least float32: per-row sums and squared norms of half-precision factors lose too much."""
    dtype = torch.float32
    for t in tensors:
        if t.is_floating_point():
            dtype = torch.promote_types(dtype, t.dtype)
    return dtype


_HALF = (torch.bfloat16, torch.float16)


def _matmul_dtype(*tensors: Tensor) -> torch.dtype:
    """The dtype the factors' matrix products run in: their own when all are one half-precision dtype (tensor
    cores on a GPU; the product accumulates in float32 inside the kernel and is rounded once, as autograd's own
    weight gradients are), else ``_compute_dtype``. Upcasting half factors would copy every activation and run
    the products without tensor cores; what is summed from the products (Grams, norms) is summed in float32."""
    dtypes = {t.dtype for t in tensors if t.is_floating_point()}
    if len(dtypes) == 1 and next(iter(dtypes)) in _HALF:
        return dtypes.pop()
    return _compute_dtype(*tensors)


def call_terms(kind: str, module: nn.Module, saved: Tensor | ScaledOutput, grad_out: Tensor) -> dict[str, Term]:
    """Per-row gradient terms of one call of ``module``, by parameter attribute name (trainable ones only)."""
    B = grad_out.shape[0]
    terms: dict[str, Term] = {}
    want = {name for name, p in module.named_parameters(recurse=False) if p.requires_grad}
    if kind in ("linear", "conv1d"):
        a_BNI = saved.reshape(B, -1, saved.shape[-1])
        g_BNO = grad_out.reshape(B, -1, grad_out.shape[-1])
        if "weight" in want:  # Linear stores [out, in], Conv1D [in, out].
            terms["weight"] = MatrixTerm(g_BNO, a_BNI) if kind == "linear" else MatrixTerm(a_BNI, g_BNO)
        if "bias" in want:
            terms["bias"] = VectorTerm(g_BNO.to(_compute_dtype(g_BNO)).sum(1))
    elif kind == "embedding":
        ids_BN = saved.reshape(B, -1)
        g_BND = grad_out.reshape(B, ids_BN.shape[1], -1)
        if module.padding_idx is not None:  # F.embedding gives the padding row no gradient.
            g_BND = g_BND.masked_fill((ids_BN == module.padding_idx)[..., None], 0.0)
        terms["weight"] = MatrixTerm(ids_BN, g_BND)
    else:  # norms: dy/dweight = x_hat elementwise, dy/dbias = 1.
        x_hat = saved.output if isinstance(saved, ScaledOutput) else saved
        for name in want:
            numel = getattr(module, name).numel()
            grad = grad_out.to(_compute_dtype(grad_out, x_hat))
            per_token = grad * x_hat if name == "weight" else grad
            per_row = per_token.reshape(B, -1, numel).sum(1)
            if name == "weight" and isinstance(saved, ScaledOutput):
                per_row = per_row / saved.scale.reshape(-1).to(per_row.dtype)
            terms[name] = VectorTerm(per_row)
    return terms


def _left_gram(left_i: Tensor, left_j: Tensor, dtype: torch.dtype) -> Tensor:
    """[b, Ni, Nj] inner products of left factors; an index stands for a one-hot row."""
    if left_i.dim() == 2 and left_j.dim() == 2:
        return (left_i[:, :, None] == left_j[:, None, :]).to(dtype)
    if left_i.dim() == 2:
        return _left_gram(left_j, left_i, dtype).transpose(1, 2)
    if left_j.dim() == 2:  # <dense_t, onehot(id_s)> = dense_t[id_s]
        return left_i.to(dtype).gather(2, left_j[:, None, :].expand(-1, left_i.shape[1], -1))
    return torch.bmm(left_i.to(dtype), left_j.to(dtype).transpose(1, 2))


def _cut(x: Tensor, chunk: RowChunk) -> Tensor:
    """Rows ``chunk.rows`` of a [B, N, ...] factor (or [B, N] ids), their first ``chunk.n`` tokens rounded up to a
    multiple of 8 within N (a view; the tokens past a row's gradient-carrying ones have zero gradient)."""
    return x[chunk.rows, : aligned(chunk.n)]


def _gram_sq_norms(terms: list[MatrixTerm], chunk: RowChunk, dtype: torch.dtype) -> Tensor:
    """``||sum_n l_n r_n^T||^2 = sum_{n,m} (l_n . l_m)(r_n . r_m)`` per row: cost ~N^2 (rows + columns).
    Products in ``dtype``, their elementwise product and sum in at least float32."""
    acc = _compute_dtype(*(t.right_BNC for t in terms))
    total = 0.0
    for i, ti in enumerate(terms):
        for j in range(i, len(terms)):
            tj = terms[j]
            right = torch.bmm(_cut(ti.right_BNC, chunk).to(dtype), _cut(tj.right_BNC, chunk).to(dtype).transpose(1, 2))
            pair = (_left_gram(_cut(ti.left, chunk), _cut(tj.left, chunk), dtype).to(acc) * right.to(acc)).sum((1, 2))
            total = total + (pair if i == j else 2.0 * pair)
    return total


def _materialised(terms: list[MatrixTerm], chunk: RowChunk, shape: tuple[int, int], dtype: torch.dtype) -> Tensor:
    """[b, R, C] per-row gradients of the rows of ``chunk``, in ``dtype``: cost ~N R C."""
    n_rows = chunk.rows.stop - chunk.rows.start
    grad_bRC = torch.zeros(n_rows, *shape, dtype=dtype, device=terms[0].right_BNC.device)
    for t in terms:
        right = _cut(t.right_BNC, chunk).to(dtype)
        if t.left.dim() == 3:
            grad_bRC.baddbmm_(_cut(t.left, chunk).to(dtype).transpose(1, 2), right)
        else:
            flat_ids = _cut(t.left, chunk) + torch.arange(n_rows, device=right.device)[:, None] * shape[0]
            grad_bRC.view(-1, shape[1]).index_add_(0, flat_ids.reshape(-1), right.reshape(-1, shape[1]))
    return grad_bRC


def _sparse_sq_norms(terms: list[MatrixTerm], n_weight_rows: int, dtype: torch.dtype) -> Tensor:
    """Embedding-only weights: each row's gradient has a non-zero row per distinct id, summed by key: cost ~N C."""
    B = terms[0].left.shape[0]
    row_B1 = torch.arange(B, device=terms[0].left.device)[:, None]
    keys = torch.cat([(t.left + row_B1 * n_weight_rows).reshape(-1) for t in terms])
    values = torch.cat([t.right_BNC.reshape(-1, t.right_BNC.shape[-1]).to(dtype) for t in terms])
    unique_keys, inverse = torch.unique(keys, return_inverse=True)
    sums = values.new_zeros(len(unique_keys), values.shape[1]).index_add_(0, inverse, values)
    return values.new_zeros(B).index_add_(0, unique_keys // n_weight_rows, sums.square().sum(1))


def prefer_gram(n_tokens: float, n_rows: int, n_cols: int) -> bool:
    """Token Gram (~N^2 (R + C) per row) rather than the materialised gradient (~N R C per row), for rows of
    ``n_tokens`` gradient-carrying tokens on average."""
    return n_tokens * (n_rows + n_cols) <= n_rows * n_cols


def sq_norms(param: nn.Parameter, terms: list[Term], lengths: list[int]) -> Tensor:
    """[B] float64 ``||sum_terms grad_b||^2`` of one parameter; a matrix picks Gram or materialised by cost.
    ``lengths``: each row's gradient-carrying tokens (its first ones) in every call's factors."""
    if any(isinstance(t, HeadTerm) for t in terms):
        return _head_param_sq_norms(terms)
    if isinstance(terms[0], VectorTerm):
        return sum(t.grad_BP for t in terms).square().sum(1).double()
    dtype = _compute_dtype(param, *(t.right_BNC for t in terms))
    if all(t.left.dim() == 2 for t in terms):
        return _sparse_sq_norms(terms, param.shape[0], dtype).double()
    factors = [x for t in terms for x in (t.left, t.right_BNC)]
    R, C = param.shape
    # a weight called k times has k n tokens a row in its Gram
    use_gram = prefer_gram(len(terms) * sum(lengths) / max(len(lengths), 1), R, C)
    dense = all(t.left.dim() == 3 for t in terms)  # index factors (an embedding) accumulate in float32
    mm_dtype = _matmul_dtype(param, *factors)
    if not use_gram and dense and mm_dtype in _HALF and len(terms) == 1:  # one product, its squares summed in float32
        return _shared_materialised_sq_norms(terms, mm_dtype, lengths).double()
    chunks = []
    for chunk in row_chunks(lengths, None if use_gram else R * C):
        if use_gram:
            chunks.append(_gram_sq_norms(terms, chunk, mm_dtype))
        else:
            grad_bRC = _materialised(terms, chunk, (R, C), mm_dtype if dense else dtype)
            chunks.append(grad_bRC.to(dtype).square().sum((1, 2)))
    return torch.cat(chunks).double() if len(chunks) > 1 else chunks[0].double()


def _head_param_sq_norms(terms: list[Term]) -> Tensor:
    """[B] float64 squared norms of the LM head's weight or bias (vcpo.variance.ghost_head), with a tied input
    embedding's own part (sparse, by id) and its cross term with the head's."""
    (head,) = [t for t in terms if isinstance(t, HeadTerm)]
    weight_sq, bias_sq = head_sq_norms(head)
    if head.part == "bias":
        return bias_sq.double()
    others = [t for t in terms if t is not head]
    if any(not isinstance(t, MatrixTerm) or t.left.dim() != 2 for t in others):
        raise NotImplementedError("fast grad norms: the LM head's weight is used by a module other than an embedding")
    total = weight_sq.double()
    if others:
        dtype = _compute_dtype(head.head.weight, *(t.right_BNC for t in others))
        total = total + _sparse_sq_norms(others, head.head.out_features, dtype).double()
        for t in others:
            total = total + tied_cross(head, t.left, t.right_BNC).double()
    return total


def weighted_grad(param: nn.Parameter, terms: list[Term], coef_B: Tensor) -> Tensor:
    """``sum_b coef_b grad_b`` of one parameter, in the parameter's shape and dtype."""
    if isinstance(terms[0], VectorTerm):
        dtype = _compute_dtype(param, *(t.grad_BP for t in terms))
        total = sum(coef_B.to(dtype) @ t.grad_BP.to(dtype) for t in terms)
        return total.view_as(param).to(param.dtype)
    dtype = _compute_dtype(param, *(t.right_BNC for t in terms))
    R, C = param.shape
    total = torch.zeros(R, C, dtype=dtype, device=param.device)
    for t in terms:
        right_MC = (coef_B.to(dtype)[:, None, None] * t.right_BNC.to(dtype)).reshape(-1, C)
        mm_dtype = _matmul_dtype(param, t.left, t.right_BNC)
        if t.left.dim() == 3 and mm_dtype == dtype:
            total.addmm_(t.left.to(dtype).reshape(-1, R).T, right_MC)
        elif t.left.dim() == 3:  # half factors: the product in their dtype (tensor cores), summed in float32
            total += (t.left.to(mm_dtype).reshape(-1, R).T @ right_MC.to(mm_dtype)).to(dtype)
        else:
            total.index_add_(0, t.left.reshape(-1), right_MC)
    return total.to(param.dtype)


def _factor_key(t: Tensor) -> tuple:
    """The identity of a factor's data. Modules that read one tensor (q/k/v, gate/up) hold views of the same
    memory, and hooked activations are never modified in place (checked at capture), so equal keys mean equal
    factors."""
    return (t.data_ptr(), t.dtype, tuple(t.shape), t.stride())


def dense_single_term(param: nn.Parameter, terms: list[Term]) -> MatrixTerm | None:
    """The term of a weight used by one module call with dense factors (a Linear or Conv1D), else None."""
    if len(terms) == 1 and isinstance(terms[0], MatrixTerm) and terms[0].left.dim() == 3 and param.dim() == 2:
        return terms[0]
    return None


def shared_gram_sq_norms(terms: list[MatrixTerm], dtype: torch.dtype, lengths: list[int]) -> Tensor:
    """[B] ``sum_terms ||sum_n l_n r_n^T||^2`` by token Grams, one Gram per distinct factor tensor, each row
    chunk's Grams over its gradient-carrying tokens only (``lengths``).

    q/k/v (and gate/up) read the same input, so their input Gram is computed once and multiplied by the sum of
    their output-gradient Grams: ``sum_p <A, G_p> = <A, sum_p G_p>``. Grams are products in ``dtype``, held and
    summed in at least float32."""
    groups: dict[tuple, tuple[Tensor, list[Tensor]]] = {}
    for t in terms:
        groups.setdefault(_factor_key(t.right_BNC), (t.right_BNC, []))[1].append(t.left)
    chunks = []
    for chunk in row_chunks(lengths, None):
        grams: dict[tuple, Tensor] = {}
        total = torch.zeros(chunk.rows.stop - chunk.rows.start, dtype=_compute_dtype(terms[0].right_BNC),
                            device=terms[0].right_BNC.device)
        for right, lefts in groups.values():
            left_sum = sum(_cached_gram(x, chunk, dtype, grams) for x in lefts)
            total += (_cached_gram(right, chunk, dtype, grams) * left_sum).sum((1, 2))
        chunks.append(total)
    return torch.cat(chunks)


def _cached_gram(x: Tensor, chunk: RowChunk, dtype: torch.dtype, cache: dict[tuple, Tensor]) -> Tensor:
    """[b, n, n] token Gram of the chunk's rows and tokens of ``x`` (a product in ``dtype``, held in at least
    float32), computed once per distinct factor tensor."""
    key = _factor_key(x)
    if key not in cache:
        xr = _cut(x, chunk).to(dtype)
        cache[key] = bmm_widened(xr, xr.transpose(1, 2))
    return cache[key]


def shared_weighted_grads(items: list[tuple[nn.Parameter, MatrixTerm]], coef_B: Tensor) -> list[Tensor]:
    """``sum_b coef_b grad_b`` of each dense single-term weight, as one matmul each.

    The coefficients scale one factor per weight, the one cheapest per use: a factor shared by several weights
    (the input of q/k/v) is scaled once, and otherwise the narrower one. Half-precision factors are scaled in
    float32 and rounded once, then multiplied in their own dtype."""
    keys = [(_factor_key(t.left), _factor_key(t.right_BNC)) for _, t in items]
    uses = Counter(k for pair in keys for k in pair)
    scaled: dict[tuple, Tensor] = {}

    def scale(x: Tensor, key: tuple, dtype: torch.dtype) -> Tensor:
        if key not in scaled:  # a half factor times float32 coefficients: a float32 product, rounded once
            scaled[key] = (x * coef_B.to(_compute_dtype(x))[:, None, None]).to(dtype).reshape(-1, x.shape[-1])
        return scaled[key]

    grads = []
    for (param, t), (kl, kr) in zip(items, keys, strict=True):
        dtype = _matmul_dtype(param, t.left, t.right_BNC)
        scale_left = kl in scaled or (
            kr not in scaled and t.left.shape[-1] / uses[kl] < t.right_BNC.shape[-1] / uses[kr]
        )
        if scale_left:
            left = scale(t.left, kl, dtype)
            right = t.right_BNC.to(dtype).reshape(-1, t.right_BNC.shape[-1])
        else:
            left = t.left.to(dtype).reshape(-1, t.left.shape[-1])
            right = scale(t.right_BNC, kr, dtype)
        grads.append((left.T @ right).to(param.dtype))
    return grads


def select_rows(items: list[tuple[nn.Parameter, list[Term]]], rows: Tensor) -> list[tuple[nn.Parameter, list[Term]]]:
    """The terms of the batch rows ``rows`` only (an index tensor); a factor several terms share stays shared."""
    picked: dict[tuple, Tensor] = {}
    n = rows.numel()
    # A run of consecutive rows is a view (the learner puts the rows that need norms first); others are copied.
    start = int(rows[0]) if n else 0
    consecutive = n > 0 and torch.equal(rows, torch.arange(start, start + n, device=rows.device))

    def pick(x: Tensor) -> Tensor:
        key = _factor_key(x)
        if key not in picked:
            picked[key] = x.narrow(0, start, n) if consecutive else x.index_select(0, rows)
        return picked[key]

    heads: dict[int, HeadTerm] = {}

    def restrict(t: Term) -> Term:
        if isinstance(t, HeadTerm):  # the weight's and the bias's terms share their tensors: picked once
            picked_head = heads.setdefault(id(t.hidden_BnD), t.rows(rows))
            return picked_head if picked_head.part == t.part else replace(picked_head, part=t.part)
        return VectorTerm(pick(t.grad_BP)) if isinstance(t, VectorTerm) else MatrixTerm(pick(t.left), pick(t.right_BNC))

    return [(param, [restrict(t) for t in terms]) for param, terms in items]


def total_sq_norms(
    items: list[tuple[nn.Parameter, list[Term]]], n_rows: int, device: torch.device, rows: Tensor | None = None,
    lengths_B: Tensor | None = None,
) -> Tensor:
    """[B] float64 sum over parameters of each row's squared gradient norm; with ``rows`` (an index tensor),
    those rows' norms and 0 elsewhere, at the cost of those rows only. ``lengths_B``: each row's gradient-carrying
    tokens (the first ones of the row; None: every token). Dense weights whose token Gram is the cheaper form are
    pooled, so that a factor several weights share gets one Gram."""
    total_B = torch.zeros(n_rows, dtype=torch.float64, device=device)
    if rows is not None:
        if rows.numel() > 0:
            picked = None if lengths_B is None else lengths_B.index_select(0, rows)
            total_B[rows] = total_sq_norms(select_rows(items, rows), rows.numel(), device, lengths_B=picked)
        return total_B
    if lengths_B is None:
        n = max((t.right_BNC.shape[1] for _, terms in items for t in terms if isinstance(t, MatrixTerm)), default=1)
        lengths = [n] * n_rows
    else:
        lengths = [int(n) for n in lengths_B.tolist()]
    mean_length = sum(lengths) / max(n_rows, 1)
    if lengths_B is not None:  # the chunked path: pooled by shape of work (a launch per parameter adds up on a GPU)
        pooled_B = _pooled_sq_norms(items, lengths, mean_length)
        return total_B if pooled_B is None else total_B + pooled_B.double()
    pooled: dict[torch.dtype, list[MatrixTerm]] = {}
    per_param: list[Tensor] = []
    for param, terms in items:
        term = dense_single_term(param, terms)
        if term is not None and prefer_gram(mean_length, *param.shape):
            pooled.setdefault(_matmul_dtype(param, term.left, term.right_BNC), []).append(term)
        else:
            per_param.append(sq_norms(param, terms, lengths))
    per_param += [shared_gram_sq_norms(terms, dtype, lengths).double() for dtype, terms in pooled.items()]
    for part in per_param:  # the full path keeps its order of sums (and its float results)
        total_B += part
    return total_B


def _pooled_sq_norms(
    items: list[tuple[nn.Parameter, list[Term]]], lengths: list[int], mean_length: float
) -> Tensor | None:
    """[B] (None without parameters) sum over parameters of each row's squared gradient norm, with as few kernel
    launches as the algebra allows: dense single-call weights by token Grams (one Gram per shared factor), or
    materialised together where they read one input (q/k/v: their output gradients side by side, one product and
    one norm), one-call vectors (norm weights, biases) side by side, one sum per accumulation dtype at the end."""
    grams: dict[torch.dtype, list[MatrixTerm]] = {}
    materialised: dict[tuple, list[MatrixTerm]] = {}
    vectors: dict[torch.dtype, list[Tensor]] = {}
    parts: list[Tensor] = []
    for param, terms in items:
        term = dense_single_term(param, terms)
        if term is not None and prefer_gram(mean_length, *param.shape):
            grams.setdefault(_matmul_dtype(param, term.left, term.right_BNC), []).append(term)
        elif term is not None and (mm := _matmul_dtype(param, term.left, term.right_BNC)) in _HALF:
            materialised.setdefault((_factor_key(term.right_BNC), mm), []).append(term)
        elif len(terms) == 1 and isinstance(terms[0], VectorTerm):
            grad = terms[0].grad_BP
            vectors.setdefault(grad.dtype, []).append(grad)
        else:
            parts.append(sq_norms(param, terms, lengths))
    parts += [shared_gram_sq_norms(terms, dtype, lengths) for dtype, terms in grams.items()]
    parts += [_shared_materialised_sq_norms(terms, dtype, lengths) for (_, dtype), terms in materialised.items()]
    parts += [torch.cat(grads, 1).square().sum(1) for grads in vectors.values()]
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for part in parts:
        by_dtype.setdefault(part.dtype, []).append(part)
    sums = [torch.stack(group).sum(0) if len(group) > 1 else group[0] for group in by_dtype.values()]
    if not sums:
        return None
    return sums[0] if len(sums) == 1 else sum(x.double() for x in sums)


def _shared_materialised_sq_norms(terms: list[MatrixTerm], dtype: torch.dtype, lengths: list[int]) -> Tensor:
    """[B] ``sum_terms ||sum_n l_n r_n^T||^2`` of half-precision weights that share their right factor (the input
    of q/k/v): the left factors side by side make one [rows of all, C] product a row, squared and summed in float32."""
    right = terms[0].right_BNC
    left = torch.cat([t.left for t in terms], -1) if len(terms) > 1 else terms[0].left
    chunks = []
    for chunk in row_chunks(lengths, left.shape[-1] * right.shape[-1]):
        grad_bRC = torch.bmm(_cut(left, chunk).to(dtype).transpose(1, 2), _cut(right, chunk).to(dtype))
        chunks.append(torch.linalg.vector_norm(grad_bRC, dim=(1, 2), dtype=torch.float32).square())
    return torch.cat(chunks) if len(chunks) > 1 else chunks[0]


def weighted_grads(
    items: list[tuple[nn.Parameter, list[Term]]], coef_B: Tensor
) -> list[tuple[nn.Parameter, Tensor]]:
    """``(param, sum_b coef_b grad_b)`` for every parameter; dense single-term weights share scaled factors, the
    LM head's weight and bias come from one pass over its vocabulary (plus a tied embedding's own part)."""
    dense: list[tuple[nn.Parameter, MatrixTerm]] = []
    result: list[tuple[nn.Parameter, Tensor]] = []
    head_params: dict[str, tuple[nn.Parameter, list[Term]]] = {}
    for param, terms in items:
        if any(isinstance(t, HeadTerm) for t in terms):
            head_params[next(t for t in terms if isinstance(t, HeadTerm)).part] = (param, terms)
            continue
        term = dense_single_term(param, terms)
        if term is None:
            result.append((param, weighted_grad(param, terms, coef_B)))
        else:
            dense.append((param, term))
    result += zip((param for param, _ in dense), shared_weighted_grads(dense, coef_B), strict=True)
    if head_params:
        param, terms = head_params.get("weight", next(iter(head_params.values())))
        head = next(t for t in terms if isinstance(t, HeadTerm))
        grad_w, grad_b = head_weighted_grads(head, coef_B, want_bias="bias" in head_params)
        if "weight" in head_params:
            others = [t for t in terms if t is not head]  # a tied embedding
            result.append((param, grad_w + weighted_grad(param, others, coef_B) if others else grad_w))
        if "bias" in head_params:
            result.append((head_params["bias"][0], grad_b))
    return result
