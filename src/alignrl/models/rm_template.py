"""A reward model that reads another tokenizer than the policy's (verl's `reward_model.model.input_tokenizer`).

Such a model cannot read the policy's token ids. Each rollout row is turned back into a conversation: the prompt's
chat messages (the row's `Sample.messages`, as verl's `raw_prompt`) and the response decoded with the policy's
tokenizer (special tokens kept, the eos text removed, as verl does), appended as the assistant turn. That conversation
goes through the reward model's own chat template and tokenizer, is cut to `max_length` tokens (its first ones kept:
verl's right truncation) and is scored at its last token.

`reward_input` decides, once, whether a run needs this: a reward model whose tokenizer has the policy's vocabulary and
chat template reads the policy's ids directly (the ids path, unchanged), and one of another vocabulary without
`algorithm.reward_model_retemplate` is refused in one line rather than scoring ids that mean other words to it.

Deliberately left out: verl's left/middle truncation modes, and re-templating the cost model (verl has none).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from alignrl.data.collate import left_pad
from alignrl.models.folder import TOKENIZER_FILES, ModelError, first_line, read_config

KEY = "algorithm.reward_model_retemplate"


@dataclass(frozen=True)
class RmTemplate:
    """How rows reach a reward model of its own tokenizer: that tokenizer (with a chat template) and the longest
    input in its tokens."""

    tokenizer: object
    max_length: int


def response_text(policy_tokenizer, ids: Sequence[int]) -> str:
    """The response as verl hands it to the reward model: decoded with special tokens kept, the eos text removed
    (a tool turn's markers stay: they are part of what the policy wrote or read)."""
    text = policy_tokenizer.decode(list(ids), skip_special_tokens=False)
    eos = policy_tokenizer.eos_token
    return text.replace(eos, "") if eos else text


def chat_ids(rm_tokenizer, messages: Sequence[dict], response: str, max_length: int | None) -> list[int]:
    """The reward model's ids of `messages` plus the assistant's `response`, in its chat template, at most
    `max_length` of them (the first ones: the end of a longer conversation is not scored; None: all)."""
    chat = [dict(m) for m in messages] + [{"role": "assistant", "content": response}]
    try:
        text = rm_tokenizer.apply_chat_template(chat, add_generation_prompt=False, tokenize=False)
    except Exception as exc:  # the template's own check (a role order it refuses, an image part): its first line
        raise ModelError(f"the reward model's chat template cannot render a row's conversation ({first_line(exc)}); "
                         "give it prompts its template takes, or a reward model of the policy's tokenizer") from exc
    # the template wrote the special tokens it wants; the tokenizer's own (a second bos) would be extra
    return rm_tokenizer(text, add_special_tokens=False)["input_ids"][:max_length]


def row_ids(policy_tokenizer, template: RmTemplate, messages: Sequence[dict], response: Sequence[int],
            cut: bool = True) -> list[int]:
    """One row's reward-model ids: its prompt `messages` and the policy's `response` ids (no padding); `cut`: at most
    template.max_length of them."""
    return chat_ids(template.tokenizer, messages, response_text(policy_tokenizer, response),
                    template.max_length if cut else None)


def retemplated_ids(policy_tokenizer, template: RmTemplate, messages: Sequence[Sequence[dict]],
                    response_ids: torch.Tensor, response_mask: torch.Tensor, cut: bool = True) -> list[list[int]]:
    """Each row's reward-model ids (`messages[i]`: row i's prompt messages; responses (B, R) right-padded)."""
    if len(messages) != len(response_ids):
        raise ValueError(f"{len(messages)} prompts' messages for {len(response_ids)} responses; give one per row")
    return [row_ids(policy_tokenizer, template, m, ids[mask.bool()].tolist(), cut)
            for m, ids, mask in zip(messages, response_ids, response_mask)]


class RetemplatingScorer:
    """A SequenceScorer of the policy's rows over `inner`, a scorer of the reward model's own ids (the in-process
    ModelScorer, or the Ray reward group): each row re-templated (`retemplated_ids`), then scored whole, as a prompt
    with an empty response, at its last token. The reward stage gives the rows' messages (`takes_messages`)."""

    takes_messages = True

    def __init__(self, inner, policy_tokenizer, template: RmTemplate, log: Callable = print):
        self.inner, self.policy_tokenizer, self.template, self.log = inner, policy_tokenizer, template, log
        self.name = getattr(inner, "name", type(inner).__name__)
        pad = template.tokenizer.pad_token_id
        self.pad_id = 0 if pad is None else pad  # masked out: any id the model has will do
        self.noted = False

    def score(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, response_ids: torch.Tensor,
              response_mask: torch.Tensor, messages: Sequence[Sequence[dict]] = ()) -> torch.Tensor:
        """Scores (B,); the prompts' ids are the policy's, unused: the prompts are read from `messages`."""
        rows = retemplated_ids(self.policy_tokenizer, self.template, messages, response_ids, response_mask, cut=False)
        n, over = self.template.max_length, sum(len(r) > self.template.max_length for r in rows)
        if over and not self.noted:  # verl cuts as silently; a score of half a response should not be a surprise
            self.noted = True
            self.log(f"reward model: {over} of {len(rows)} conversations are over {n} tokens in its chat template and "
                     f"are scored on their first {n} (algorithm.reward_model_max_length; said once)")
        ids, mask = left_pad([r[:n] for r in rows], self.pad_id)
        return self.inner.score(ids, mask, ids[:, :0], mask[:, :0])


def rm_tokenizer(folder: Path):
    """The reward-model folder's tokenizer; None when it holds no tokenizer files (it then reads ids as given)."""
    from alignrl.models.folder import load_tokenizer

    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        return None
    return load_tokenizer(folder, chat=False)


def same_tokenizer(a, b) -> bool:
    """Whether two tokenizers give the same ids to the same conversation: one vocabulary, one chat template."""
    return a.get_vocab() == b.get_vocab() and a.chat_template == b.chat_template


def reads_ids_of(own, policy_tokenizer) -> bool:
    """Whether a tokenizer gives every token of the policy's the policy's id (tokens of its own beside them, a pad
    token added for training, do no harm: the policy never writes them)."""
    vocab = own.get_vocab()
    return all(vocab.get(token) == i for token, i in policy_tokenizer.get_vocab().items())


def reward_input(policy_tokenizer, folder: Path, retemplate: bool, max_length: int,
                 key: str = "algorithm.reward_model", flag: str = KEY + "=true") -> RmTemplate | None:
    """How the reward model in `folder` reads the rows: None, the policy's ids (its tokenizer is the policy's, or
    it has none and its embeddings cover the policy's ids); else its own chat template and tokenizer (`retemplate`
    set, by `flag`). One-line ModelError for a vocabulary it cannot read, or a template it lacks."""
    own = rm_tokenizer(folder)
    if not retemplate:
        size = (read_config(folder) or {}).get("vocab_size")
        if own is not None and not reads_ids_of(own, policy_tokenizer):
            raise ModelError(f"{key}={folder} has another tokenizer than the policy ({len(own)} vs "
                             f"{len(policy_tokenizer)} tokens): its scores of the policy's ids would mean nothing; "
                             f"set {KEY}=true to score the decoded text in its own chat template (verl's "
                             "reward_model.model.input_tokenizer)")
        if own is None and isinstance(size, int) and size < len(policy_tokenizer):
            raise ModelError(f"{key}={folder} has {size} token embeddings, fewer than the policy's "
                             f"{len(policy_tokenizer)} tokens: it reads another vocabulary; save its tokenizer in the "
                             f"folder and set {KEY}=true")
        return None
    if own is None:
        raise ModelError(f"{flag} needs the reward model's tokenizer, but {key}={folder} has no tokenizer files; "
                         "save its tokenizer there (tokenizer.save_pretrained), or turn re-templating off for a model "
                         "of the policy's tokenizer (verl: reward_model.model.input_tokenizer=null)")
    if same_tokenizer(own, policy_tokenizer):
        return None  # re-templating would only round-trip the policy's own ids through text
    if not own.chat_template:
        raise ModelError(f"{flag}: the tokenizer of {key}={folder} has no chat template to put the conversation "
                         "in; add the one the reward model was trained with (tokenizer.chat_template, saved)")
    return RmTemplate(own, max_length)
