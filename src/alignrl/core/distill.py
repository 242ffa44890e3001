"""Knowledge distillation's token loss, as OpenRLHF's `KDLoss` (from MiniLLM) computes it: at each trained position,
the cross-entropy of the student's next-token distribution against the teacher's,

    distil(t) = -Σ_v p_teacher(v | x_<t) · log p_student(v | x_<t),

the teacher's softmax and the student's log-softmax both in float32, a student logit of ±inf (a vocabulary entry its
head masks out) adding nothing. It differs from KL(teacher ‖ student) by the teacher's entropy only, a constant of
the student: the same gradient, and a teacher that is the data's one-hot gives the plain cross-entropy.
`temperature` (TRL's GKD `temperature`) divides both models' logits first; 1 is OpenRLHF's (no scaling).
`beta` > 0 (TRL's GKD `beta`) takes the generalized Jensen-Shannon divergence of GKD (Agarwal et al., eq. 1) instead:
with the mixture m = β·p_teacher + (1 - β)·p_student, β·KL(p_teacher ‖ m) + (1 - β)·KL(p_student ‖ m); β = 1 is
KL(p_student ‖ p_teacher), the reverse KL. (β = 0 would be KL(p_teacher ‖ p_student): the cross-entropy above less
the teacher's entropy, the same gradient, so 0 keeps OpenRLHF's form.)

The training objective mixes it with the data's cross-entropy: (1 - kd_coef) · gpt_loss + kd_coef · distil_loss.
Every function takes the rows of the trained positions alone ([N, V]; `distill_mean` a padded [B, T, V] with its
mask), so the caller decides which positions train. Torch only.
"""

from __future__ import annotations

import math

import torch


def _check(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> None:
    if student_logits.shape != teacher_logits.shape:
        s, t = tuple(student_logits.shape), tuple(teacher_logits.shape)
        what = (f"the student's vocabulary has {s[-1]} entries and the teacher's {t[-1]}: the two must share a "
                "tokenizer" if s[:-1] == t[:-1] else f"student logits {s} and teacher logits {t} differ in shape")
        raise ValueError(f"distillation: {what}")


def distill_per_token(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                      temperature: float = 1.0) -> torch.Tensor:
    """-Σ_v softmax(teacher / T)(v) · log_softmax(student / T)(v) for each row ([..., V] -> [...]), in float32.
    The teacher's side carries no gradient."""
    _check(student_logits, teacher_logits)
    if temperature <= 0:
        raise ValueError(f"distillation: temperature must be > 0, got {temperature}")
    student = student_logits.float() / temperature
    teacher_probs = torch.softmax(teacher_logits.detach().float() / temperature, dim=-1)
    log_probs = torch.log_softmax(student, dim=-1)
    # OpenRLHF's inf mask: an entry the student's head sets to ±inf adds nothing (0 · -inf would be nan)
    terms = torch.masked_fill(teacher_probs * log_probs, torch.isinf(student), 0.0)
    return -terms.sum(dim=-1)


def generalized_jsd_per_token(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float,
                              temperature: float = 1.0) -> torch.Tensor:
    """GKD's divergence of each row ([..., V] -> [...]), in float32, for 0 < beta <= 1 (module doc). The teacher's
    side carries no gradient."""
    _check(student_logits, teacher_logits)
    if not 0.0 < beta <= 1.0 or temperature <= 0:
        raise ValueError(f"distillation: beta must be in (0, 1] and temperature > 0, got {beta}, {temperature}")
    log_s = torch.log_softmax(student_logits.float() / temperature, dim=-1)
    log_t = torch.log_softmax(teacher_logits.detach().float() / temperature, dim=-1)

    def kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:  # Σ p (log p - log q); p = 0 adds nothing
        inside = ~log_p.isneginf()  # the -inf entries are replaced before any product: no nan in the gradient
        log_p, log_q = torch.where(inside, log_p, 0.0), torch.where(inside, log_q, 0.0)
        return torch.where(inside, log_p.exp() * (log_p - log_q), 0.0).sum(dim=-1)

    if beta == 1.0:
        # an entry the teacher gives probability 0 (a narrower head's padding) is left out of the student's
        # distribution too: any mass there would make KL(student ‖ teacher) infinite
        outside = torch.isneginf(teacher_logits.detach())
        if outside.any():
            log_s = torch.log_softmax((student_logits.float() / temperature).masked_fill(outside, float("-inf")), -1)
        return kl(log_s, log_t)
    log_m = torch.logaddexp(log_s + math.log(1.0 - beta), log_t + math.log(beta))
    return beta * kl(log_t, log_m) + (1.0 - beta) * kl(log_s, log_m)


def distill_sum(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0,
                beta: float = 0.0) -> torch.Tensor:
    """The distillation loss summed over the rows of the trained positions ([N, V] each): the trainer divides it by
    the optimizer step's trained tokens, as it divides the cross-entropy. `beta` > 0: GKD's divergence."""
    if beta > 0.0:
        return generalized_jsd_per_token(student_logits, teacher_logits, beta, temperature).sum()
    return distill_per_token(student_logits, teacher_logits, temperature).sum()


def distill_mean(student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor,
                 temperature: float = 1.0) -> torch.Tensor:
    """The token mean over the positions `mask` marks ([B, T, V] logits, [B, T] mask), as OpenRLHF's KDLoss reduces
    it; what the unmarked positions hold (padding, prompts) never enters, nan included. No marked position: 0."""
    _check(student_logits, teacher_logits)
    keep = mask.bool()
    picked = distill_per_token(student_logits[keep], teacher_logits[keep], temperature)
    return picked.sum() / keep.sum().clamp(min=1)


def match_vocab(teacher_logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """The teacher's logits over the student's `vocab` entries, when the two heads are padded to different sizes
    beyond one shared tokenizer (the caller checks that both cover it): a wider teacher's extra entries are dropped
    (its distribution renormalised over the student's entries), a narrower one's missing entries are -inf (the
    teacher gives them probability 0)."""
    have = teacher_logits.shape[-1]
    if have == vocab:
        return teacher_logits
    if have > vocab:
        return teacher_logits[..., :vocab]
    pad = teacher_logits.new_full((*teacher_logits.shape[:-1], vocab - have), float("-inf"))
    return torch.cat([teacher_logits, pad], dim=-1)


def mix(gpt_loss: torch.Tensor, distil_loss: torch.Tensor, kd_coef: float) -> torch.Tensor:
    """OpenRLHF's objective: (1 - kd_coef) · gpt_loss + kd_coef · distil_loss. kd_coef 0 returns `gpt_loss` itself,
    kd_coef 1 `distil_loss` itself (no term times 0: a nan in the unused one stays out)."""
    if not 0.0 <= kd_coef <= 1.0:
        raise ValueError(f"distillation: kd_coef must be in [0, 1], got {kd_coef}")
    if kd_coef == 0.0:
        return gpt_loss
    if kd_coef == 1.0:
        return distil_loss
    return gpt_loss * (1.0 - kd_coef) + distil_loss * kd_coef
