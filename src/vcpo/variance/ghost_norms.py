"""Fast per-trajectory score-gradient norms ``G_b`` from ONE batched forward and ONE backward ("ghost norms" and
book-keeping from differentially private training), and the per-row gradient capture the learner assembles
``sum_b c_b grad score_b`` from without a second backward (VCPO's efficient form, ALGORITHMS.md §8).

How: forward hooks keep each supported module's input (or normalised input) and output; one
``torch.autograd.grad`` of ``sum_b score_b`` gives every kept output's gradient, which for row b is the gradient of
``score_b`` alone because rows do not interact. A weight's per-row gradient is then a sum of outer products
(see ghost_layers). On large batches (and with a float32 head) a model that splits into body and Linear head
(vcpo.variance.logprobs.split_head) runs its head over the response tokens only, a vocabulary chunk at a time
(vcpo.variance.ghost_head): no [B, T, V] tensor exists, the head's norms come from token Grams and its weighted
gradient from one more pass over the vocabulary. Small batches keep the full-logits path (unchanged numerics).
Opacus 1.6 was measured and not used: its ghost clipping refuses tied embeddings (Qwen2-0.5B, GPT-2), captures
nothing in eval mode, takes the Gram form for every layer (about 1.5x slower here) and cannot assemble a
per-row-weighted gradient.

LoRA (peft, vcpo.models.lora): an adapted layer computes ``y = W x + s B A d(x)`` with ``W`` frozen, ``s = alpha / r``
and ``d`` the adapter dropout (identity in eval mode). peft's ``lora_A`` and ``lora_B`` are plain ``nn.Linear``
modules, so each is hooked as any trainable linear layer and the frozen ``W`` (no trainable parameter) is not. With
``u_t = A d(x_t)`` (lora_A's output, lora_B's input) and ``g_t = d score_b / d y_t``, lora_B's output gradient is
``s g_t`` and lora_A's is ``s B^T g_t``, hence per row b

    ``grad_B = s sum_t g_t u_t^T``  [out, r],   ``grad_A = s B^T sum_t g_t d(x_t)^T``  [r, in],
    ``G_b = sum over adapted layers of ||grad_A||_F^2 + ||grad_B||_F^2``

each squared Frobenius norm taken by the linear rule (``sum_{t,t'} (g_t . g_t')(x_t . x_t')`` over token pairs, or the
per-row gradient materialised when that is cheaper, as it is for the r-row adapters). Nothing LoRA-specific is
needed beyond the base weights being frozen; tests/test_lora.py checks it against the exact per-row method.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor, nn

from vcpo.variance import logprobs as _logprobs
from vcpo.variance.ghost_head import HeadTerm, head_capture
from vcpo.variance.ghost_layers import (
    ScaledOutput,
    Term,
    call_terms,
    module_kind,
    save_activation,
    total_sq_norms,
    weighted_grads,
)
from vcpo.variance.logprobs import check_token_tensors, split_head, token_logprobs


@dataclass
class _Call:
    module: nn.Module
    kind: str
    saved: Tensor | ScaledOutput
    output: Tensor
    versions: tuple[int, int]
    held: dict[int, str]
    """The tensors the module held as its own parameters during the call (id -> local name): under FSDP2 its
    unsharded copies, the leaves the autograd graph holds, not the sharded parameters."""


@dataclass
class PerRowGradCapture:
    """Per-row gradient factors of every trainable parameter from one forward and backward.

    ``logprobs_BT`` are the (detached) token log-probs of that forward; ``terms`` holds, per parameter, what its
    per-row gradients are built from (activations and output gradients), so ``accumulate_grad`` needs no backward.
    """

    logprobs_BT: Tensor
    terms: list[tuple[nn.Parameter, list[Term]]] = field(repr=False)
    lengths_B: Tensor | None = field(default=None, repr=False)
    """Each row's gradient-carrying tokens: positions before its last response token (None: all)."""
    _sq_norms_B: tuple[tuple[int, ...] | None, Tensor] | None = field(default=None, init=False, repr=False)

    def sq_norms(self, rows: Tensor | None = None) -> Tensor:
        """[B] float64 ``G_b = ||grad_theta score_b||^2`` summed over parameters (a tied weight counts once).

        With ``rows`` (a [B] bool mask or an index tensor) only those rows' norms are computed, at their cost
        alone, and the others are 0. Computed once per ``rows`` and kept: the captured factors do not change."""
        B = self.logprobs_BT.shape[0]
        if rows is not None and rows.dtype == torch.bool:
            if rows.shape != (B,):
                raise ValueError(f"rows: a bool mask must have shape ({B},), got {tuple(rows.shape)}")
            rows = rows.nonzero().squeeze(1)
        if rows is not None and rows.numel() == B:
            rows = None
        key = None if rows is None else tuple(rows.tolist())
        if self._sq_norms_B is None or self._sq_norms_B[0] != key:
            self._sq_norms_B = (key, total_sq_norms(self.terms, B, self.logprobs_BT.device, rows, self.lengths_B))
        return self._sq_norms_B[1]

    def accumulate_grad(self, coef_B: Tensor) -> None:
        """Adds ``sum_b coef_B[b] * grad_theta score_b`` to each parameter's ``.grad`` (created if None).

        For VCPO's REINFORCE-form loss ``L = -(1/B) sum_b min(W_b, 8) Ahat_b (1/L_b) score_b`` pass
        ``coef_B = -min(W, 8) * Ahat / (B * L)``: the result is the gradient of L.
        """
        if coef_B.shape != self.logprobs_BT.shape[:1]:
            raise ValueError(f"coef_B {tuple(coef_B.shape)} must have one entry per row ({self.logprobs_BT.shape[0]})")
        for param, grad in weighted_grads(self.terms, coef_B.detach()):
            if param.grad is None:
                param.grad = grad
            else:
                param.grad.add_(grad)


@dataclass
class _Plan:
    key: tuple[int, ...]
    kinds: dict[nn.Module, str]
    names: dict[int, str]
    owned: dict[nn.Module, dict[str, int]]
    graph_checked: bool = False


_PLANS: weakref.WeakKeyDictionary[nn.Module, _Plan] = weakref.WeakKeyDictionary()


def _plan(model: nn.Module, params: list[nn.Parameter]
          ) -> tuple[dict[nn.Module, str], dict[int, str], dict[nn.Module, dict[str, int]]]:
    """Supported modules to hook, by rule name; each parameter's name (by id); and each hooked module's trainable
    parameters by local name. A module owning a trainable parameter that fits no rule is an error."""
    trainable = {id(p) for p in params}
    names: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    kinds, owned = {}, {}
    for module in model.modules():
        own = [p for p in module.parameters(recurse=False) if id(p) in trainable]
        if not own:
            continue
        kind = module_kind(module)
        if kind is None:
            raise NotImplementedError(
                f"fast grad norms cannot account for parameter {names[id(own[0])]!r} of a "
                f"{type(module).__name__}; use method='exact'"
            )
        kinds[module] = kind
        owned[module] = {local: id(p) for local, p in module.named_parameters(recurse=False) if id(p) in trainable}
    return kinds, names, owned


def _graph_uses(root: torch.autograd.graph.Node | None) -> dict[int, int]:
    """How many autograd edges lead into each leaf tensor (by id) in the graph of ``root``."""
    uses: dict[int, int] = {}
    seen, stack = set(), [root] if root is not None else []
    while stack:
        node = stack.pop()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            if hasattr(nxt, "variable"):
                uses[id(nxt.variable)] = uses.get(id(nxt.variable), 0) + 1
            elif nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return uses


def _hooked_forward(
    model: nn.Module, kinds: dict[nn.Module, str], input_ids: Tensor, response_mask: Tensor,
    attention_mask: Tensor | None, temperature: float, head: nn.Linear | None = None, fp32: bool = False,
    gram_B: Tensor | None = None,
) -> tuple[Tensor, Tensor, list[_Call], HeadTerm | None]:
    """``(sum_b score_b, logprobs_BT, calls, head term)``: the batched forward, keeping what each hooked module call
    needs. With ``head`` the model body runs hooked and the head runs over the response tokens in vocabulary chunks
    (``ghost_head.head_capture``, in float32 with ``fp32``), its norms for the rows ``gram_B``."""
    B, T = input_ids.shape
    calls: list[_Call] = []

    def expand_batch(module: nn.Module, args: tuple) -> tuple | None:
        # GPT-2 looks up positions for one row [1, T] and broadcasts; per-row gradients need the [B, T] lookup.
        if args and isinstance(args[0], Tensor) and args[0].shape[0] == 1 and B > 1:
            return (args[0].expand(B, *args[0].shape[1:]), *args[1:])
        return None

    def keep(module: nn.Module, args: tuple, output: Tensor) -> None:
        x = args[0] if args else None
        if not isinstance(x, Tensor) or not isinstance(output, Tensor) or tuple(x.shape[:2]) != (B, T):
            raise NotImplementedError(
                f"fast grad norms need a [B={B}, T={T}, ...] tensor input and output at {type(module).__name__}"
            )
        saved = save_activation(kinds[module], module, x, output)
        held = {id(t): local for local, t in module.named_parameters(recurse=False)}
        calls.append(_Call(module, kinds[module], saved, output, (saved._version, output._version), held))

    handles = []
    try:
        for module in kinds:
            if module is not head:
                handles.append(module.register_forward_pre_hook(expand_batch))
                handles.append(module.register_forward_hook(keep))
        with torch.enable_grad():
            head_term = None
            if head is None:
                logp_BT = token_logprobs(model, input_ids, attention_mask, temperature)
            else:
                body = model.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
                logp_BT, head_term = head_capture(head, body.last_hidden_state, input_ids, response_mask, temperature,
                                                  fp32, gram_B)
            # where, not a product: log-probs at padded positions may be non-finite.
            kept_BT = torch.where(response_mask[:, 1:].bool(), logp_BT[:, 1:], torch.zeros_like(logp_BT[:, 1:]))
            return kept_BT.sum(), logp_BT.detach(), calls, head_term
    finally:
        for handle in handles:
            handle.remove()


def _refuse_in_place(calls: list[_Call]) -> None:
    """Raises if a hooked activation changed in place after the hook kept it."""
    if any((c.saved._version, c.output._version) != c.versions for c in calls):
        raise NotImplementedError("fast grad norms: a hooked activation was modified in place during the forward")


def _refuse_unaccounted(score: Tensor, calls: list[_Call], params: list[nn.Parameter], plan: _Plan) -> None:
    """Raises if a parameter reaches the score other than through the hooked calls of the module that owns it.

    A graph leaf is matched to its parameter through what each hooked module held during its call (under FSDP2 the
    leaves are the unsharded copies of the sharded parameters); a trainable leaf that no hooked call held is a use
    outside the owning module too."""
    trainable = {id(p) for p in params}
    param_of_leaf = {pid: pid for pid in trainable}
    calls_per_param: dict[int, int] = {}
    for c in calls:
        for leaf, local in c.held.items():
            pid = plan.owned[c.module].get(local)
            if pid is not None:
                param_of_leaf[leaf] = pid
                calls_per_param[pid] = calls_per_param.get(pid, 0) + 1
    uses_per_param: dict[int, int] = {}
    for leaf, uses in _graph_uses(score.grad_fn).items():
        pid = param_of_leaf.get(leaf)
        if pid is None:
            raise NotImplementedError("fast grad norms: a trainable tensor that no hooked module held during its call "
                                      "reaches the score (a parameter used outside its module); use method='exact'")
        uses_per_param[pid] = uses_per_param.get(pid, 0) + uses
    for p in params:
        if uses_per_param.get(id(p), 0) > calls_per_param.get(id(p), 0):
            raise NotImplementedError(
                f"fast grad norms: parameter {plan.names[id(p)]!r} is used outside the modules that own it; "
                "use method='exact'"
            )


def lean_head(model: nn.Module, response_mask: Tensor, lm_head_fp32: bool = False) -> nn.Linear | None:
    """The Linear head the capture runs in vocabulary chunks (``lm_head_fp32``, or as many response logits as
    vcpo.variance.logprobs' lean path takes), or None for the full-logits path (small batches: their numerics, and
    every per-row sum's order, stay as they were). Called before any hook exists: ``split_head`` runs the model once
    per model to check the split."""
    split = split_head(model)
    if lm_head_fp32 and split is None:
        raise NotImplementedError(f"lm_head_fp32: {type(model).__name__}'s logits are not a Linear head")
    if split is None:
        return None
    n_logits = int(response_mask[:, 1:].count_nonzero()) * split[1].out_features
    return split[1] if lm_head_fp32 or n_logits >= _logprobs.LEAN_MIN_LOGITS else None


def gradient_lengths(response_mask: Tensor) -> Tensor:
    """[B] each row's gradient-carrying positions: those before its last response token (a causal model's later
    positions never reach the score), 0 for a row with none."""
    S = response_mask.shape[1]
    positions = torch.arange(1, S, device=response_mask.device)
    return (response_mask[:, 1:].bool() * positions).amax(1) if S > 1 else response_mask.new_zeros(len(response_mask))


def _capture(
    model: nn.Module, params: list[nn.Parameter], input_ids: Tensor, response_mask: Tensor,
    attention_mask: Tensor | None, temperature: float, lm_head_fp32: bool = False, rows: Tensor | None = None,
) -> PerRowGradCapture:
    # Checkpointed layers re-run their forward inside the backward, after the hooks are gone (Hugging Face
    # checkpoints a layer only in training mode).
    if any(getattr(m, "gradient_checkpointing", False) is True and m.training for m in model.modules()):
        raise NotImplementedError("fast grad norms do not support active gradient checkpointing; use method='exact'")
    head = lean_head(model, response_mask, lm_head_fp32)
    gram_B = None
    if rows is not None:  # the head's Grams for these rows only (others on demand)
        gram_B = rows if rows.dtype == torch.bool else torch.zeros(len(input_ids), dtype=torch.bool,
                                                                     device=input_ids.device).index_fill(0, rows, True)
    # The plan and the graph check depend on the model's structure only: done once per model and trainable set.
    key = tuple(id(p) for p in params)
    plan = _PLANS.get(model)
    if plan is None or plan.key != key:
        plan = _PLANS[model] = _Plan(key, *_plan(model, params))
    score, logp_BT, calls, head_term = _hooked_forward(
        model, plan.kinds, input_ids, response_mask, attention_mask, temperature, head, lm_head_fp32, gram_B
    )
    _refuse_in_place(calls)
    if not plan.graph_checked:
        _refuse_unaccounted(score, calls, params, plan)
        plan.graph_checked = True
    # Rows do not interact, so the gradient of sum_b score_b at row b's activations is that of score_b alone.
    live = [c for c in calls if c.output.requires_grad]
    grads = torch.autograd.grad(score, [c.output for c in live], allow_unused=True) if live else ()
    terms_by_param: dict[int, tuple[nn.Parameter, list[Term]]] = {}
    for c, grad_out in zip(live, grads, strict=True):
        if grad_out is None:  # the output does not reach the score
            continue
        for name, term in call_terms(c.kind, c.module, c.saved, grad_out.detach()).items():
            param = getattr(c.module, name)
            terms_by_param.setdefault(id(param), (param, []))[1].append(term)
    if head_term is not None:
        for part in ("weight", "bias"):
            param = getattr(head, part)
            if param is not None and param.requires_grad:
                term = head_term if part == "weight" else replace(head_term, part="bias")
                terms_by_param.setdefault(id(param), (param, []))[1].append(term)
    # the chunked path trims each row to its gradient-carrying tokens; the full path keeps its shapes (and sums)
    lengths_B = gradient_lengths(response_mask) if head is not None else None
    return PerRowGradCapture(logp_BT, list(terms_by_param.values()), lengths_B)


def per_row_grad_capture(
    model: nn.Module, input_ids: Tensor, response_mask: Tensor, attention_mask: Tensor | None = None,
    temperature: float = 1.0, rows: Tensor | None = None, lm_head_fp32: bool = False,
) -> tuple[Tensor, PerRowGradCapture]:
    """``(G_B, capture)`` from one batched forward and one backward, with

        ``score_b = sum_t response_mask[b, t] * log p_theta(input_ids[b, t] | input_ids[b, <t])`` (t >= 1),
        ``G_b = || grad_theta score_b ||^2`` over all trainable parameters (a tied weight counts once)

    (the ``G_i`` of VCPO's OPOB, arXiv 2602.17616, §8.3). ``capture.accumulate_grad(coef_B)`` then adds
    ``sum_b coef_b grad_theta score_b`` to the parameters' ``.grad``, and ``capture.logprobs_BT`` holds the
    forward's log-probs (logits divided by ``temperature``). The parameters' ``.grad`` are untouched until then.
    Supports nn.Linear, nn.Embedding, nn.LayerNorm, nn.RMSNorm, Hugging Face RMSNorm classes and GPT-2's Conv1D;
    a trainable parameter it cannot account for raises NotImplementedError naming it. ``rows`` (a [B] bool mask
    or indices) limits ``G_B`` to those rows, 0 elsewhere (see ``PerRowGradCapture.sq_norms``). ``lm_head_fp32``
    computes the LM head's logits in float32 (``vcpo.variance.logprobs.head_logits``), as the learner's other
    passes and the engine then do. On large batches (or with ``lm_head_fp32``) the head runs a vocabulary chunk at a
    time over the response tokens (vcpo.variance.ghost_head) and the capture holds no vocabulary-sized tensor;
    small batches take the full logits, whose [B, T, V] gradient the capture then holds.
    """
    check_token_tensors(input_ids, response_mask=response_mask, attention_mask=attention_mask)
    params = list({id(p): p for p in model.parameters() if p.requires_grad}.values())
    if not params:
        raise ValueError("per_row_grad_capture: the model has no trainable parameters (requires_grad)")
    capture = _capture(model, params, input_ids, response_mask, attention_mask, temperature, lm_head_fp32, rows)
    return capture.sq_norms(rows), capture


def ghost_grad_sq_norms(
    model: nn.Module, params: list[nn.Parameter], input_ids: Tensor, response_mask: Tensor,
    attention_mask: Tensor | None,
) -> Tensor:
    """``trajectory_grad_sq_norms(..., method="fast")``: [B] float64 ``G_b`` by one forward and one backward."""
    return _capture(model, params, input_ids, response_mask, attention_mask, 1.0).sq_norms()
