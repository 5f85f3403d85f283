"""vcpo's objective, OPOB and ESS-scaled learning rate inside a plain PyTorch + transformers loop.

No vcpo trainer, config or rollout engine: a Hugging Face causal LM samples with ``model.generate`` from a copy of
itself that catches up only every ``lag`` steps (a stale behaviour policy, as in asynchronous RL, so the importance
weights are not 1), and each step takes what vcpo's pure functions compute:

    behaviour log-probs   recorded at sampling, from generate's scores (the distribution actually sampled from)
    log-weights, ESS      vcpo.variance.sequence_log_weights, ess_ratio (unclipped, over the whole batch)
    G_i                   vcpo.variance.trajectory_grad_sq_norms: each trajectory's squared score-gradient norm
    advantages            vcpo.variance.opob_advantages: the off-policy optimal baseline of each group
    loss                  vcpo.objectives.get_objective("vcpo"): sequence-level truncated IS, cap 8
    step size             lr * vcpo.variance.ess_lr_scale(rho): set before optimizer.step(), then restored

The task: prompts ``a+b=`` of two digits summing below 10; reward 1 for the right digit, 0.5 for another digit.
    python examples/own_loop.py [--model DIR] [--steps 40] [--lag 2]
Without --model a tiny random Llama with vcpo's character tokenizer is built (nothing is downloaded).
"""

from __future__ import annotations

import argparse
import copy
import random

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from vcpo.objectives import ObjectiveInputs, get_objective
from vcpo.variance import ess_lr_scale, ess_ratio, opob_advantages, sequence_log_weights, trajectory_grad_sq_norms


def load(model_dir: str | None, seed: int):
    """A Hugging Face causal LM and its tokenizer: ``model_dir``, or a tiny random Llama."""
    if model_dir is not None:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        return model, AutoTokenizer.from_pretrained(model_dir)
    from vcpo.models.default import BASE_CHARACTERS, build_char_tokenizer

    tokenizer = build_char_tokenizer(BASE_CHARACTERS)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                         tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config), tokenizer


def reward(text: str, answer: str) -> float:
    first = text.strip()[:1]
    return 1.0 if first == answer else 0.5 if first.isdigit() else 0.0


def logprobs(model, ids_BS: torch.Tensor, attention_BS: torch.Tensor) -> torch.Tensor:
    """[B, S] log p(ids[t] | ids[<t]) (0 at t = 0), the positions ``trajectory_grad_sq_norms`` uses."""
    logp_BTV = torch.log_softmax(model(input_ids=ids_BS, attention_mask=attention_BS).logits[:, :-1].float(), -1)
    return torch.nn.functional.pad(logp_BTV.gather(-1, ids_BS[:, 1:, None]).squeeze(-1), (1, 0))


@torch.no_grad()
def sample(behaviour, tokenizer, prompts: list[str], max_new_tokens: int):
    """Token ids [B, S], behaviour log-probs [B, S] recorded at sampling, response mask, attention mask, and the
    responses' text. Prompts of one token length need no padding: generate and the learner see the same positions."""
    ids_BP = tokenizer(prompts, return_tensors="pt", add_special_tokens=False)["input_ids"]
    out = behaviour.generate(ids_BP, attention_mask=torch.ones_like(ids_BP), do_sample=True, temperature=1.0,
                             top_k=0, top_p=1.0, max_new_tokens=max_new_tokens, output_scores=True,
                             return_dict_in_generate=True, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id)
    ids_BS, P = out.sequences, ids_BP.shape[1]
    new_BN = ids_BS[:, P:]
    scores_BNV = torch.stack(out.scores, dim=1).float()  # the processed logits each token was drawn from
    blp_BN = torch.log_softmax(scores_BNV, -1).gather(-1, new_BN[..., None]).squeeze(-1)
    ended_BN = (new_BN == tokenizer.eos_token_id).long().cumsum(1)  # tokens after the first EOS are padding
    response_BN = ((ended_BN == 0) | ((ended_BN == 1) & (new_BN == tokenizer.eos_token_id))).float()
    response_BS = torch.nn.functional.pad(response_BN, (P, 0))
    blp_BS = torch.nn.functional.pad(torch.where(response_BN.bool(), blp_BN, 0.0), (P, 0))
    attention_BS = torch.cat([torch.ones_like(ids_BP), response_BN.long()], dim=1)
    return ids_BS, blp_BS, response_BS, attention_BS, tokenizer.batch_decode(new_BN, skip_special_tokens=True)


def train(steps: int = 40, lag: int = 2, prompts_per_step: int = 8, group_size: int = 8, lr: float = 3e-3,
          max_new_tokens: int = 3, model_dir: str | None = None, seed: int = 0, say=print) -> list[dict]:
    """The loop; returns one record per step (its quantities, for inspection and tests)."""
    policy, tokenizer = load(model_dir, seed)
    policy.eval()  # no dropout: the learner's log-probs are the sampling policy's
    behaviour = copy.deepcopy(policy)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=lr)
    objective = get_objective("vcpo")
    rng, history, synced = random.Random(seed), [], 0
    torch.manual_seed(seed)
    for step in range(steps):
        if step % lag == 0:  # the sampler catches up with the learner every `lag` steps; in between it is stale
            behaviour.load_state_dict(policy.state_dict())
            synced = step
        firsts = [rng.randint(0, 9) for _ in range(prompts_per_step)]
        pairs = [(a, rng.randint(0, 9 - a)) for a in firsts]  # sums below 10: one digit
        prompts = [f"{a}+{b}=" for a, b in pairs for _ in range(group_size)]  # a group of samples per prompt
        answers = [str(a + b) for a, b in pairs for _ in range(group_size)]
        ids_BS, blp_BS, mask_BS, attention_BS, texts = sample(behaviour, tokenizer, prompts, max_new_tokens)
        rewards_B = torch.tensor([reward(t, a) for t, a in zip(texts, answers, strict=True)])
        group_ids_B = torch.arange(prompts_per_step).repeat_interleave(group_size)

        lp_BS = logprobs(policy, ids_BS, attention_BS)
        logw_B = sequence_log_weights(lp_BS.detach(), blp_BS, mask_BS)  # log W_i = sum_t m (log pi - log mu)
        rho = float(ess_ratio(logw_B))  # ESS / B of the unclipped weights
        G_B = trajectory_grad_sq_norms(policy, ids_BS, mask_BS, attention_BS)  # ||grad sum_t log pi||^2 per row
        adv_B = opob_advantages(rewards_B, logw_B, G_B, group_ids_B)  # (R - b_g) / sigma_g, b_g by W^2 G
        out = objective(ObjectiveInputs(logprobs=lp_BS, behavior_logprobs=blp_BS, advantages=adv_B, mask=mask_BS,
                                        rewards=rewards_B, group_ids=group_ids_B))
        optimizer.zero_grad()
        out.loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0))
        scale = ess_lr_scale(rho, reference=1.0, rule="sqrt")  # sqrt(min(1, rho)): scale the step, not the grad
        for group in optimizer.param_groups:
            group["lr"] = lr * scale
        optimizer.step()
        for group in optimizer.param_groups:
            group["lr"] = lr
        history.append({"step": step, "lag": step - synced, "reward": float(rewards_B.mean()), "ess_ratio": rho,
                        "lr": lr * scale, "loss": float(out.loss.detach()), "grad_norm": grad_norm,
                        "clip_frac": out.metrics["clip/frac"], "logw": logw_B.tolist(), "G": G_B.tolist(),
                        "rewards": rewards_B.tolist(), "advantages": adv_B.tolist(),
                        "group_ids": group_ids_B.tolist()})
        say(f"step {step:3d}  lag {step - synced}  reward {rewards_B.mean():.3f}  ESS/B {rho:.3f}  "
            f"lr {lr * scale:.2e}  |grad| {grad_norm:.3f}  loss {float(out.loss.detach()):+.4f}")
    return history


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a local Hugging Face model directory (default: a tiny one)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--lag", type=int, default=2, help="the behaviour policy catches up every LAG steps")
    args = parser.parse_args()
    train(args.steps, args.lag, model_dir=args.model)
