"""The search demo's world, built from a seed: invented people, facts about them that no model can know,
a retrieval corpus stating each fact, questions in Search-R1's layout, and the SFT trajectories of the
base model.

Every person has three facts (hometown, trade, instrument), each one passage titled with the person's
name, in Search-R1's corpus layout (`{"id", "contents": "\\"Title\\"\\ntext"}`). People are split three
ways: `sft` (the base model's fine-tuning trajectories), `train` (RL prompts) and `test` (held out), so
neither the base model nor RL can memorise a held-out answer; only a search finds it. Questions follow
Search-R1's `nq_search.py` layout: `data_source` "nq", `reward_model.ground_truth = {"target": [answer]}`,
the prompt as a user turn (the question alone, not its instruction template: see PROMPT_TEMPLATE); its
extra `question`/`golden_answers` columns are left out (alignrl reads `prompt`, `data_source`,
`reward_model`, `extra_info`).

Deliberately left out: multi-hop questions and distractor passages; one search answers each question.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from alignrl.data.records import Sample
from alignrl.rollout.agent import INVALID_ACTION

DATA_DIR = Path(__file__).parent / "data"
CORPUS_FILE, TRAIN_FILE, TEST_FILE = "search_corpus.jsonl", "search_train.parquet", "search_test.parquet"
DATA_SOURCE = "nq"  # Search-R1's name: its exact-match reward scores these questions

# The question alone, in Search-R1's `Question: ...` form. Search-R1's template adds ~150 tokens of
# instructions that a 1M-parameter model cannot read: on this CPU they would make every SFT and PPO step
# about five times as long for nothing; the tags it teaches come from the SFT trajectories instead.
PROMPT_TEMPLATE = "Question: {question}\n"

_ONSETS = ["b", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "gl", "kr",
           "th", "sh", "st", "tr", "qu"]
_VOWELS = ["a", "e", "i", "o", "u", "ae", "ei", "ou"]
_CODAS = ["", "", "", "n", "r", "l", "s", "th", "m", "x"]


@dataclass(frozen=True)
class Relation:
    name: str
    question: str  # "{e}": the person
    sentence: str  # "{e}", "{v}": the person and the value (a full stop is added)
    suffixes: tuple[str, ...]  # invented values end in these, so each relation's values look alike
    proper_noun: bool = False  # values are capitalised (city names)


# Questions end with the person and passages with the value, and every relation is one word, so both
# copies (the person's name into the query, the value into the answer) span the same distance whatever
# the relation. Questions say "What's", not "What is": " is" then comes before the value only, so the
# word before it points at one place in the episode (see search_response).
RELATIONS = (
    Relation("hometown", "What's the hometown of {e}?", "The hometown of {e} is {v}",
             ("hollow", "mere", "ford", "wick", "stead", "haven"), proper_noun=True),
    Relation("trade", "What's the trade of {e}?", "The trade of {e} is {v}",
             ("smith", "wright", "monger", "weaver", "binder")),
    Relation("instrument", "What's the instrument of {e}?", "The instrument of {e} is {v}",
             ("lin", "phone", "horn", "harp", "pipe")),
)
SPLITS = ("sft", "train", "test")


@dataclass(frozen=True)
class Fact:
    person: str
    relation: Relation
    value: str

    @property
    def question(self) -> str:
        return self.relation.question.format(e=self.person)

    @property
    def passage(self) -> str:
        """Search-R1's corpus layout: the quoted title on the first line, the text after it."""
        return f'"{self.person}"\n' + self.relation.sentence.format(e=self.person, v=self.value) + "."


@dataclass(frozen=True)
class WorldSize:
    # SFT sees each of its facts about once: the base model learns to copy, not to memorise answers
    people: tuple[int, int, int] = (3000, 200, 100)  # per split: sft, train, test
    values_per_relation: int = 40
    names: int = 64  # given names and family names each; a person is one of each


@dataclass(frozen=True)
class World:
    facts: dict[str, list[Fact]]  # split -> facts
    values: dict[str, list[str]]  # relation name -> its possible values

    def all_facts(self) -> list[Fact]:
        return [f for split in SPLITS for f in self.facts[split]]


def _syllable(rng: random.Random) -> str:
    return rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)


def _word(rng: random.Random, syllables: int, suffix: str = "") -> str:
    return ("".join(_syllable(rng) for _ in range(syllables)) + suffix).capitalize()


def _value(rng: random.Random, relation: Relation) -> str:
    word = _word(rng, rng.randint(1, 2), rng.choice(relation.suffixes))
    return word if relation.proper_noun else word.lower()


def _unique(make: Callable[[], str], n: int) -> list[str]:
    out: dict[str, None] = {}
    while len(out) < n:
        out.setdefault(make())
    return list(out)


def build_world(seed: int = 0, size: WorldSize = WorldSize()) -> World:
    """People, values and facts, all drawn from `seed` (the same seed gives the same world)."""
    rng = random.Random(seed)
    values = {r.name: _unique(lambda r=r: _value(rng, r), size.values_per_relation) for r in RELATIONS}
    # Pools of given and family names, each used by many people: the tokenizer learns every name as one
    # token, so a search query copies two tokens of the question rather than a dozen syllables.
    given, family = (_unique(lambda: _word(rng, 2), size.names) for _ in range(2))
    people = _unique(lambda: f"{rng.choice(given)} {rng.choice(family)}", sum(size.people))
    facts, start = {}, 0
    for split, n in zip(SPLITS, size.people):
        facts[split] = [Fact(p, r, rng.choice(values[r.name])) for p in people[start:start + n] for r in RELATIONS]
        start += n
    return World(facts, values)


def corpus_rows(world: World) -> list[dict]:
    return [{"id": str(i), "contents": f.passage} for i, f in enumerate(world.all_facts())]


def question_samples(facts: Sequence[Fact], split: str) -> list[Sample]:
    """Search-R1 rows: the templated question as the user turn, the answer as `{"target": [...]}`."""
    return [Sample(messages=[{"role": "user", "content": PROMPT_TEMPLATE.format(question=f.question)}],
                   ground_truth={"target": [f.value]}, data_source=DATA_SOURCE,  # type: ignore[arg-type]
                   extra={"split": split, "index": i}) for i, f in enumerate(facts)]


def write_data(out_dir: Path, seed: int = 0, size: WorldSize = WorldSize()) -> dict[str, Path]:
    """The corpus (jsonl) and the RL and held-out questions (verl parquet) of `build_world(seed, size)`."""
    from alignrl.data.loaders import write_verl_parquet

    world = build_world(seed, size)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"corpus": out_dir / CORPUS_FILE, "train": out_dir / TRAIN_FILE, "test": out_dir / TEST_FILE}
    paths["corpus"].write_text("".join(json.dumps(r) + "\n" for r in corpus_rows(world)))
    for split in ("train", "test"):
        write_verl_parquet(question_samples(world.facts[split], split), paths[split])
    return paths


# ---- the base model's SFT trajectories -------------------------------------------------------------

def search_response(fact: Fact, observation: str) -> str:
    """Think, search with the question as the query, read the observation (the rollout's own text for
    it, `\\n\\n<information>...</information>\\n\\n`), restate the passage's sentence in a think (as
    Search-R1's prompt asks after new information) and answer with its value.

    Restating the sentence is what makes copying learnable quickly: its words follow the passage's word
    for word, so the value comes after the same words (`... is`) in both, the pattern by which small
    models learn to copy (the name, copied the same way from the question into the query and the
    passage, is learnt first); copying a lone value straight into `<answer>` stays on a plateau."""
    return (f"<think> I do not know this. </think>\n<search> {fact.question}</search>{observation}"
            f"<think> {fact.relation.sentence.format(e=fact.person, v=fact.value)}. </think>\n"
            f"<answer> {fact.value}</answer>")


def guess_response(fact: Fact, guess: str) -> str:
    """Answer without searching: a value of the right kind, almost always the wrong one."""
    return f"<think> I know this. </think>\n<answer> {guess}</answer>"


def sft_samples(world: World, observe: Callable[[list[str]], list[str]], search_fraction: float,
                seed: int) -> list[Sample]:
    """One trajectory per `sft` fact: a seeded `search_fraction` of them search (`observe(queries)` gives
    each query's observation text), the rest guess."""
    rng = random.Random(seed)
    facts = world.facts["sft"]
    searching = [rng.random() < search_fraction for _ in facts]
    guesses = [rng.choice(world.values[f.relation.name]) for f in facts]
    queries = [f.question for f, s in zip(facts, searching) if s]
    observations = iter(observe(queries) if queries else [])
    return [Sample(q.messages, q.ground_truth, q.data_source,
                   {"answer": search_response(f, next(observations)) if s else guess_response(f, g)})
            for f, s, g, q in zip(facts, searching, guesses, question_samples(facts, "sft"))]


def tokenizer_texts(world: World, samples: Sequence[Sample]) -> list[str]:
    """What the demo tokenizer is trained on: prompts, trajectories and passages, cut at every newline.
    Byte-level BPE never merges across a pre-token, and `>\\n\\n` is one pre-token in a whole trajectory
    but two pieces in a rollout (`</search>` generated, `\\n\\n<information>` appended); with no merge
    learned across such a seam, both tokenise alike and SFT teaches the very ids rollouts produce."""
    texts = [f.passage for f in world.all_facts()] + [PROMPT_TEMPLATE.format(question=f.question)
                                                      for f in world.facts["sft"][:50]]
    texts += [s.extra["answer"] for s in samples] + [INVALID_ACTION] * 20  # the rollout's corrective observation
    return [p for t in texts for p in t.split("\n") if p] + ["\n", "\n\n"] * 50
