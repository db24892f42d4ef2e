"""The offline toy world: a generated encyclopedia of invented people and organisations, with QA splits.

Why it is built this way:

* **Retrieval is necessary.** Every fact is drawn at random (a person's birthplace, employer, occupation; an
  organisation's city and founder), so no question can be answered from its text or from priors beyond
  guessing among the answer strings (24 cities by default: ~4% closed-book).
* **Retriever training matters.** Each person has a *near-twin* with probability `twin_rate` (one letter
  changed in the name: "Talia Vorne" / "Talia Vorna") whose different facts are stated with the same verbs,
  each fact is stated with one of several paraphrase templates ("was born in", "is a native of", "hails
  from", ...) that the questions do not reuse verbatim, and every person also has *mention* passages that
  name them next to a city or organisation in some other relation ("X once visited Y"). An off-the-shelf
  sentence encoder ranks by name and surface overlap and so confuses twins and relations; a retriever
  trained on the train questions can learn the name precision and the relation paraphrases.
* **The reader can learn.** Passages are one fact sentence plus an optional neutral filler sentence
  (15-40 words with the title), answers are copied spans, and the number of distinct answer strings of the
  main question types is small and fixed (cities, occupations).
* **Held-out evaluation.** Each person and organisation belongs to one split, and every fact a dev/test
  question depends on (including the bridge of a two-hop question) belongs to entities of that split, so
  memorising train facts answers nothing on dev or test.

Question types (`question_types`): single-hop `born_in`, `works_for`, `occupation`, `located_in`,
`founded_by`; two-hop `employer_city` (works_for then located_in) and `founder_birthplace` (founded_by then
born_in). Every question lists its gold passage ids (two for two-hop questions).

Output (`build_toy_world(out_dir, ...)`): `corpus.jsonl` `{id, title, text}`, `train.jsonl` / `dev.jsonl` /
`test.jsonl` `{id, question, answers, gold_passage_ids, meta}`, and `world.json` (parameters and counts).
Everything is a deterministic function of the parameters and the seed, and is streamed to disk, so 1M
passages take about a minute and little memory.
"""

from __future__ import annotations

import json
import math
import os
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rlm.base.atomicio import atomic_open
from rlm.errors import UserError

SPLITS = ("train", "dev", "test")
QUESTION_TYPES = (
    "born_in",
    "works_for",
    "occupation",
    "located_in",
    "founded_by",
    "employer_city",
    "founder_birthplace",
)
OCCUPATIONS = (
    "architect",
    "baker",
    "carpenter",
    "chemist",
    "dentist",
    "engineer",
    "farmer",
    "geologist",
    "journalist",
    "librarian",
    "pilot",
    "sculptor",
    "surgeon",
    "tailor",
    "translator",
    "veterinarian",
)

_ONSETS = (
    "b",
    "d",
    "f",
    "g",
    "k",
    "l",
    "m",
    "n",
    "p",
    "r",
    "s",
    "t",
    "v",
    "z",
    "br",
    "dr",
    "gr",
    "tr",
    "th",
    "sh",
)
_VOWELS = ("a", "e", "i", "o", "u")
_CODAS = ("n", "r", "l", "s", "th", "rn", "nd", "x")
_FEMININE_ENDINGS = ("a", "ia", "elle", "ine", "ora", "ys")
_MASCULINE_ENDINGS = ("o", "en", "ar", "ic", "us", "an")
_CITY_SUFFIXES = (
    "moor",
    "ford",
    "haven",
    "dale",
    "wick",
    "bury",
    "stead",
    "holm",
    "port",
    "gate",
    "mere",
    "field",
)
_ORG_SUFFIXES = (
    "Labs",
    "Works",
    "Foundry",
    "Mills",
    "Partners",
    "Systems",
    "Trading",
    "Press",
    "Logistics",
    "Studios",
)

# Fact templates. Questions never reuse a template's phrase verbatim for most of them, so matching needs more
# than word overlap; {p} is the subject pronoun, {P} capitalised.
_FACT_TEMPLATES = {
    "born_in": (
        "{name} was born in {obj}.",
        "{name} is a native of {obj}.",
        "{name} hails from {obj}, where {p} spent {pos} early years.",
        "The birthplace of {name} is {obj}.",
        "{name} came into the world in the town of {obj}.",
    ),
    "works_for": (
        "{name} works for {obj}.",
        "{name} is employed by {obj}.",
        "{name} has a job at {obj}.",
        "{name} draws a salary from {obj}.",
        "These days {name} is on the staff of {obj}.",
    ),
    "occupation": (
        "{name} works as {a} {obj}.",
        "{name} is {a} {obj} by trade.",
        "By profession, {name} is {a} {obj}.",
        "{name} earns a living as {a} {obj}.",
        "{name} trained and now practises as {a} {obj}.",
    ),
    "located_in": (
        "{name} is based in {obj}.",
        "{name} has its headquarters in {obj}.",
        "The head office of {name} is in {obj}.",
        "{name} operates out of {obj}.",
    ),
    "founded_by": (
        "{name} was founded by {obj}.",
        "{obj} is the founder of {name}.",
        "{name} was started by {obj}.",
        "{obj} set up {name} some years ago.",
    ),
}
# Mention distractors: the subject next to a city or organisation in a relation no question asks about.
_CITY_MENTIONS = (
    "{name} once visited {obj} on a long trip.",
    "{name} spent a summer holiday in {obj}.",
    "{name} gave a public talk in {obj} last spring.",
    "{name} has a cousin who lives in {obj}.",
)
_ORG_MENTIONS = (
    "{name} once applied for a job at {obj}.",
    "{name} bought a product made by {obj}.",
    "{name} read a report about {obj} in the news.",
)
# Kin distractors (`kin_facts`): for each relation the world asks about, facts about a relative of the subject
# (a person's family, an organisation's partners) in the very words the questions use, naming the subject, and
# never with the subject's own answer. An off-the-shelf sentence encoder ranks them above the subject's own
# paraphrased facts; only a retriever trained on the task learns that "the mother of X" is not X.
_PERSON_KIN = ("mother", "father", "brother", "sister", "aunt", "uncle", "grandmother", "grandfather")
_ORG_KIN = ("parent company", "main rival", "largest client", "chief supplier", "sister company")
_KIN_TEMPLATES = {
    "born_in": ("The {kin} of {name} was born in {obj}.", "{name}'s {kin} was born in {obj}."),
    "works_for": ("The {kin} of {name} works for {obj}.", "{name}'s {kin} works for {obj}."),
    "occupation": ("The {kin} of {name} works as {a} {obj}.", "{name}'s {kin} works as {a} {obj}."),
    "located_in": ("The {kin} of {name} is located in {obj}.", "{name}'s {kin} is headquartered in {obj}."),
    "founded_by": ("The {kin} of {name} was founded by {obj}.", "{name}'s {kin} was founded by {obj}."),
}
_PERSON_RELATIONS = ("born_in", "works_for", "occupation")
_ORG_RELATIONS = ("located_in", "founded_by")
_PERSON_FILLERS = (
    "{P} is known for a quiet sense of humour.",
    "Friends describe {o} as patient and curious.",
    "{P} enjoys long walks and old maps.",
    "{P} collects postcards from many places.",
    "{P} likes to cook for friends on weekends.",
    "Neighbours say {p} rarely misses a concert.",
    "{P} keeps a small garden behind the house.",
    "{P} learned to play the violin as a child.",
)
_ORG_FILLERS = (
    "It employs a few hundred people.",
    "Its annual report is published every autumn.",
    "It is known for careful record keeping.",
    "The company has grown steadily over the years.",
)
_QUESTION_TEMPLATES = {
    "born_in": ("Where was {s} born?", "In which city was {s} born?", "What is the birthplace of {s}?"),
    "works_for": (
        "Which company does {s} work for?",
        "Who employs {s}?",
        "What is the name of the employer of {s}?",
    ),
    "occupation": ("What is the occupation of {s}?", "What does {s} do for a living?", "What is {s}'s job?"),
    "located_in": ("In which city is {s} located?", "Where is {s} headquartered?"),
    "founded_by": ("Who founded {s}?", "Who is the founder of {s}?"),
    "employer_city": (
        "In which city is the company that employs {s} located?",
        "Where is the employer of {s} headquartered?",
    ),
    "founder_birthplace": (
        "Where was the founder of {s} born?",
        "In which city was the founder of {s} born?",
    ),
}
_PRONOUNS = {"f": ("she", "her", "her"), "m": ("he", "him", "his")}


@dataclass(frozen=True)
class ToyWorldPaths:
    """Where a toy world's files are."""

    root: Path
    corpus: Path
    train: Path
    dev: Path
    test: Path
    manifest: Path

    def split(self, name: str) -> Path:
        """Path of the `train`, `dev` or `test` QA file."""
        if name not in SPLITS:
            raise UserError(f"toy world splits are {', '.join(SPLITS)}, not {name!r}")
        return getattr(self, name)


@dataclass
class ToyWorldConfig:
    """Every knob of the generator (all recorded in world.json)."""

    num_passages: int = 2000
    seed: int = 0
    num_cities: int = 24
    num_occupations: int = 16
    persons_per_org: int = 5
    mentions_per_person: int = 1
    kin_facts: int = 0  # kin distractors per entity and asked relation (see _KIN_TEMPLATES)
    twin_rate: float = 0.5
    filler_rate: float = 0.7
    split_fractions: tuple[float, float, float] = (0.8, 0.1, 0.1)
    question_types: tuple[str, ...] = QUESTION_TYPES
    max_questions: dict[str, int | None] = field(
        default_factory=lambda: {"train": None, "dev": 2000, "test": 2000}
    )

    def validate(self) -> None:
        if self.num_passages < 100:
            raise UserError(f"num_passages must be at least 100, got {self.num_passages}")
        if not 2 <= self.num_cities <= 2000:
            raise UserError(f"num_cities must be in [2, 2000], got {self.num_cities}")
        if not 2 <= self.num_occupations <= len(OCCUPATIONS):
            raise UserError(f"num_occupations must be in [2, {len(OCCUPATIONS)}], got {self.num_occupations}")
        if self.persons_per_org < 1 or self.mentions_per_person < 0 or self.kin_facts < 0:
            raise UserError("persons_per_org must be >= 1, mentions_per_person and kin_facts >= 0")
        if not 0 <= self.twin_rate <= 1 or not 0 <= self.filler_rate <= 1:
            raise UserError("twin_rate and filler_rate must be in [0, 1]")
        if len(self.split_fractions) != 3 or abs(sum(self.split_fractions) - 1) > 1e-6:
            raise UserError(f"split_fractions must be three numbers summing to 1, got {self.split_fractions}")
        unknown = set(self.question_types) - set(QUESTION_TYPES)
        if unknown or not self.question_types:
            raise UserError(
                f"unknown question types {sorted(unknown)}; choose from {', '.join(QUESTION_TYPES)}"
            )


@dataclass
class _Person:
    name: str
    gender: str
    split: str
    born_in: str = ""
    works_for: int = -1
    occupation: str = ""
    passage_ids: dict[str, str] = field(default_factory=dict)


@dataclass
class _Org:
    name: str
    split: str
    located_in: str = ""
    founder: int = -1
    passage_ids: dict[str, str] = field(default_factory=dict)


class _Names:
    """Invented names, unique across all entity kinds."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.used: set[str] = set()

    def _syllable(self) -> str:
        return self.rng.choice(_ONSETS) + self.rng.choice(_VOWELS)

    def _unique(self, make) -> str:
        for _ in range(1000):
            name = make()
            if name not in self.used:
                self.used.add(name)
                return name
        raise RuntimeError("name space exhausted; this should not happen below 10M entities")

    def person(self, gender: str) -> str:
        endings = _FEMININE_ENDINGS if gender == "f" else _MASCULINE_ENDINGS

        def make() -> str:
            first = (self._syllable() + self.rng.choice(endings)).capitalize()
            last = (self._syllable() + self._syllable() + self.rng.choice(_CODAS)).capitalize()
            return f"{first} {last}"

        return self._unique(make)

    def twin(self, name: str) -> str | None:
        """A near-duplicate: one vowel of the surname (or first name) replaced by another."""
        first, last = name.split(" ", 1)
        for _ in range(20):
            which = self.rng.random() < 0.75
            word = last if which else first
            positions = [i for i, ch in enumerate(word) if ch.lower() in _VOWELS]
            i = self.rng.choice(positions)
            new = self.rng.choice([v for v in _VOWELS if v != word[i].lower()])
            new = new.upper() if word[i].isupper() else new
            word = word[:i] + new + word[i + 1 :]
            candidate = f"{first} {word}" if which else f"{word} {last}"
            if candidate not in self.used:
                self.used.add(candidate)
                return candidate
        return None

    def city(self) -> str:
        return self._unique(lambda: (self._syllable() + self.rng.choice(_CITY_SUFFIXES)).capitalize())

    def org(self) -> str:
        return self._unique(
            lambda: (
                f"{(self._syllable() + self._syllable() + self.rng.choice(_CODAS)).capitalize()} "
                f"{self.rng.choice(_ORG_SUFFIXES)}"
            )
        )


class _CorpusWriter:
    def __init__(self, f):
        self.f = f
        self.count = 0

    def write(self, title: str, text: str) -> str:
        pid = f"tw{self.count:07d}"
        self.f.write(json.dumps({"id": pid, "title": title, "text": text}, ensure_ascii=False) + "\n")
        self.count += 1
        return pid


def _asked(config: ToyWorldConfig, relations: Sequence[str]) -> list[str]:
    """The single-hop relations among `relations` that some question type of the world asks about."""
    hops = {"employer_city": ("works_for",), "founder_birthplace": ("founded_by",)}
    asked = {r for t in config.question_types for r in hops.get(t, (t,))}
    return [r for r in relations if r in asked]


def _passages_per_entity(config: ToyWorldConfig) -> tuple[int, int]:
    """(passages of one person, of one organisation) that `_write_passages` writes."""
    person_kin = config.kin_facts * len(_asked(config, _PERSON_RELATIONS))
    org_kin = config.kin_facts * len(_asked(config, _ORG_RELATIONS))
    return 3 + config.mentions_per_person + person_kin, 2 + org_kin


def _persons_for(config: ToyWorldConfig) -> int:
    person_passages, org_passages = _passages_per_entity(config)
    per_person = person_passages + org_passages / config.persons_per_org
    # Organisations are rounded up in each split: leave room for one extra (2 passages) per split.
    return max(10, math.floor((config.num_passages - 2 * len(SPLITS)) / per_person))


def _planned_passages(config: ToyWorldConfig, persons, orgs) -> int:
    """How many passages `_write_passages` writes for these entities (before padding)."""
    person_passages, org_passages = _passages_per_entity(config)
    return len(persons) * person_passages + len(orgs) * org_passages


def _toy_world_paths(root: Path) -> ToyWorldPaths:
    return ToyWorldPaths(
        root=root,
        corpus=root / "corpus.jsonl",
        train=root / "train.jsonl",
        dev=root / "dev.jsonl",
        test=root / "test.jsonl",
        manifest=root / "world.json",
    )


def _draw_world(config: ToyWorldConfig):
    """(rng, cities, occupations, persons, orgs): the entities drawn from the seed, as many persons as fit;
    `rng` goes on to draw the passages and questions."""
    num_persons = _persons_for(config)
    while True:
        rng = random.Random(config.seed)
        names = _Names(rng)
        cities = [names.city() for _ in range(config.num_cities)]
        occupations = list(OCCUPATIONS[: config.num_occupations])
        persons, orgs = _make_entities(config, rng, names, cities, occupations, num_persons)
        # Organisations are rounded up per split, so a small world with many passages per entity can plan
        # more than fits; it is drawn again with one person fewer (never the case at the default settings).
        if _planned_passages(config, persons, orgs) <= config.num_passages or num_persons <= 3:
            return rng, cities, occupations, persons, orgs
        num_persons -= 1


def _write_corpus(path: Path, config: ToyWorldConfig, rng, persons, orgs, cities, occupations) -> int:
    """Write exactly `config.num_passages` passages to `path`; returns how many were written."""
    with atomic_open(path) as f:
        writer = _CorpusWriter(f)
        _write_passages(config, rng, writer, persons, orgs, cities, occupations)
        if writer.count > config.num_passages:
            raise RuntimeError(f"toy world overshot: {writer.count} > {config.num_passages} passages")
        # Pad to the exact size with more mention distractors (harmless: they answer no question).
        while writer.count < config.num_passages:
            _write_mention(
                rng, writer, persons[rng.randrange(len(persons))], cities, orgs, config.filler_rate
            )
        return writer.count


def _write_questions(paths: ToyWorldPaths, config: ToyWorldConfig, rng, persons, orgs) -> dict[str, int]:
    """Write each split's questions (shuffled, capped by `max_questions`); returns how many per split."""
    counts = {}
    for split in SPLITS:
        questions = _make_questions(config, rng, split, persons, orgs)
        rng.shuffle(questions)
        cap = config.max_questions.get(split)
        questions = questions if cap is None else questions[:cap]
        with atomic_open(paths.split(split)) as f:
            for n, q in enumerate(questions):
                q["id"] = f"{split}-{n:06d}"
                f.write(json.dumps(q, ensure_ascii=False) + "\n")
        counts[split] = len(questions)
    return counts


def _write_manifest(path: Path, config: ToyWorldConfig, counts: dict, cities, occupations) -> None:
    """world.json: the generator's settings, what it made (`counts`) and the answer vocabularies."""
    manifest = {
        "generator": "rlm.data.toy_world",
        "version": 1,
        "config": {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(config).items()},
        "counts": counts,
        "answer_vocab": {"cities": cities, "occupations": occupations},
    }
    with atomic_open(path) as f:
        f.write(json.dumps(manifest, indent=2) + "\n")


def build_toy_world(
    out_dir: str | os.PathLike,
    num_passages: int = 2000,
    seed: int = 0,
    **options,
) -> ToyWorldPaths:
    """Generate a toy world of exactly `num_passages` passages into `out_dir`; deterministic from the seed.

    `options` are the other `ToyWorldConfig` fields (num_cities, twin_rate, question_types, max_questions,
    ...). Returns the paths of the written files.
    """
    config = ToyWorldConfig(num_passages=num_passages, seed=seed, **options)
    config.validate()
    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    paths = _toy_world_paths(root)
    rng, cities, occupations, persons, orgs = _draw_world(config)
    num_written = _write_corpus(paths.corpus, config, rng, persons, orgs, cities, occupations)
    questions = _write_questions(paths, config, rng, persons, orgs)
    counts = {
        "passages": num_written,
        "persons": len(persons),
        "organisations": len(orgs),
        "cities": len(cities),
        "questions": questions,
    }
    _write_manifest(paths.manifest, config, counts, cities, occupations)
    return paths


def _make_entities(config, rng, names, cities, occupations, num_persons) -> tuple[list[_Person], list[_Org]]:
    persons: list[_Person] = []
    while len(persons) < num_persons:
        split = rng.choices(SPLITS, weights=config.split_fractions)[0]
        gender = rng.choice("fm")
        person = _Person(names.person(gender), gender, split)
        persons.append(person)
        if len(persons) < num_persons and rng.random() < config.twin_rate:
            twin = names.twin(person.name)
            if twin is not None:
                persons.append(_Person(twin, gender, split))
    by_split = {s: [i for i, p in enumerate(persons) if p.split == s] for s in SPLITS}
    orgs: list[_Org] = []
    org_by_split: dict[str, list[int]] = {s: [] for s in SPLITS}
    for split in SPLITS:
        members = by_split[split]
        for _ in range(max(1, math.ceil(len(members) / config.persons_per_org)) if members else 0):
            org = _Org(names.org(), split, located_in=rng.choice(cities))
            # The founder comes from the same split, so a dev two-hop question needs only dev facts.
            org.founder = rng.choice(members)
            org_by_split[split].append(len(orgs))
            orgs.append(org)
    for person in persons:
        person.born_in = rng.choice(cities)
        person.occupation = rng.choice(occupations)
        person.works_for = rng.choice(org_by_split[person.split])
    return persons, orgs


def _fact_text(rng, relation: str, name: str, obj: str, gender: str | None, filler_rate: float) -> str:
    p, o, pos = _PRONOUNS[gender] if gender else ("it", "it", "its")
    article = "an" if obj[:1].lower() in "aeiou" else "a"
    sentence = rng.choice(_FACT_TEMPLATES[relation]).format(name=name, obj=obj, p=p, pos=pos, a=article)
    if rng.random() < filler_rate:
        fillers = _PERSON_FILLERS if gender else _ORG_FILLERS
        sentence += " " + rng.choice(fillers).format(P=p.capitalize(), p=p, o=o)
    return sentence


def _write_mention(rng, writer: _CorpusWriter, person: _Person, cities, orgs, filler_rate: float) -> None:
    p, o, _ = _PRONOUNS[person.gender]
    if rng.random() < 0.6:
        text = rng.choice(_CITY_MENTIONS).format(name=person.name, obj=rng.choice(cities))
    else:
        text = rng.choice(_ORG_MENTIONS).format(name=person.name, obj=orgs[rng.randrange(len(orgs))].name)
    if rng.random() < filler_rate:
        text += " " + rng.choice(_PERSON_FILLERS).format(P=p.capitalize(), p=p, o=o)
    writer.write(person.name, text)


def _write_kin_fact(
    rng, writer: _CorpusWriter, name: str, kin: Sequence[str], relation: str, truth: str, draw
):
    """One relative's fact: the question's own words, an object from `draw()` other than the subject's."""
    obj = draw()
    while obj == truth:
        obj = draw()
    article = "an" if obj[:1].lower() in "aeiou" else "a"
    template = rng.choice(_KIN_TEMPLATES[relation])
    writer.write(name, template.format(kin=rng.choice(kin), name=name, obj=obj, a=article))


def _write_passages(config, rng, writer: _CorpusWriter, persons, orgs, cities, occupations) -> None:
    person_kin = _asked(config, _PERSON_RELATIONS) if config.kin_facts else []
    org_kin = _asked(config, _ORG_RELATIONS) if config.kin_facts else []
    # Entities are written in a shuffled order so that row numbers say nothing about splits or twins.
    order = [("p", i) for i in range(len(persons))] + [("o", i) for i in range(len(orgs))]
    rng.shuffle(order)
    for kind, i in order:
        if kind == "p":
            person = persons[i]
            facts = [
                ("born_in", person.born_in),
                ("works_for", orgs[person.works_for].name),
                ("occupation", person.occupation),
            ]
            rng.shuffle(facts)
            for relation, obj in facts:
                text = _fact_text(rng, relation, person.name, obj, person.gender, config.filler_rate)
                person.passage_ids[relation] = writer.write(person.name, text)
            for _ in range(config.mentions_per_person):
                _write_mention(rng, writer, person, cities, orgs, config.filler_rate)
            truths = {
                "born_in": (person.born_in, lambda: rng.choice(cities)),
                "works_for": (orgs[person.works_for].name, lambda: orgs[rng.randrange(len(orgs))].name),
                "occupation": (person.occupation, lambda: rng.choice(occupations)),
            }
            for relation in person_kin:
                for _ in range(config.kin_facts):
                    _write_kin_fact(rng, writer, person.name, _PERSON_KIN, relation, *truths[relation])
        else:
            org = orgs[i]
            for relation, obj in (("located_in", org.located_in), ("founded_by", persons[org.founder].name)):
                text = _fact_text(rng, relation, org.name, obj, None, config.filler_rate)
                org.passage_ids[relation] = writer.write(org.name, text)
            truths = {
                "located_in": (org.located_in, lambda: rng.choice(cities)),
                "founded_by": (persons[org.founder].name, lambda: persons[rng.randrange(len(persons))].name),
            }
            for relation in org_kin:
                for _ in range(config.kin_facts):
                    _write_kin_fact(rng, writer, org.name, _ORG_KIN, relation, *truths[relation])


def _question(rng, qtype: str, subject: str, answer: str, gold: Sequence[str]) -> dict:
    return {
        "id": "",
        "question": rng.choice(_QUESTION_TEMPLATES[qtype]).format(s=subject),
        "answers": [answer],
        "gold_passage_ids": list(gold),
        "meta": {"type": qtype, "hops": len(gold), "subject": subject},
    }


def _make_questions(config, rng, split: str, persons, orgs) -> list[dict]:
    types = set(config.question_types)
    out = []
    for person in persons:
        if person.split != split:
            continue
        employer = orgs[person.works_for]
        ids = person.passage_ids
        if "born_in" in types:
            out.append(_question(rng, "born_in", person.name, person.born_in, [ids["born_in"]]))
        if "works_for" in types:
            out.append(_question(rng, "works_for", person.name, employer.name, [ids["works_for"]]))
        if "occupation" in types:
            out.append(_question(rng, "occupation", person.name, person.occupation, [ids["occupation"]]))
        if "employer_city" in types:
            gold = [ids["works_for"], employer.passage_ids["located_in"]]
            out.append(_question(rng, "employer_city", person.name, employer.located_in, gold))
    for org in orgs:
        if org.split != split:
            continue
        founder = persons[org.founder]
        if "located_in" in types:
            out.append(
                _question(rng, "located_in", org.name, org.located_in, [org.passage_ids["located_in"]])
            )
        if "founded_by" in types:
            out.append(_question(rng, "founded_by", org.name, founder.name, [org.passage_ids["founded_by"]]))
        if "founder_birthplace" in types:
            gold = [org.passage_ids["founded_by"], founder.passage_ids["born_in"]]
            out.append(_question(rng, "founder_birthplace", org.name, founder.born_in, gold))
    return out
