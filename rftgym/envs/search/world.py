"""A generated world for multi-hop QA with no data files.

A :class:`World` is made from a seed: countries, cities, companies and people with made-up names,
attributes (a currency, a river, an industry, an occupation, a birth year) and relations
(birthplace, employer, headquarters, founder, country). Each entity is rendered as one short
document, which states its attributes and names the entities it points to.

A question with ``hops`` = h follows h - 1 relations from a start entity, then asks for an
attribute of the entity reached, so answering it needs exactly h documents, one per hop::

    hops 1: What is the occupation of Alda Mertz?
    hops 3: What is the currency of the country of the birthplace of Alda Mertz?

An unanswerable question asks the same kind of chain about a person who is not in the world;
the right answer is a refusal (``unknown``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ...core.errors import ConfigError
from .corpora import Document, Question

MAX_HOPS = 4

_ONSETS = ("b", "br", "c", "d", "dr", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "st", "t", "v", "z")
_VOWELS = ("a", "e", "i", "o", "u", "ae", "io")
_CODAS = ("", "", "n", "r", "l", "s", "th", "x", "m")
_OCCUPATIONS = ("architect", "botanist", "cartographer", "chemist", "engineer", "historian", "journalist",
                "linguist", "painter", "pilot", "sculptor", "surgeon")
_INDUSTRIES = ("aerospace", "banking", "brewing", "mining", "publishing", "shipbuilding", "software", "textile")
_COMPANY_SUFFIXES = ("Works", "Systems", "Holdings", "Labs", "Industries")

# relation name -> (from type, to type, phrase in a question)
RELATIONS = {
    "birthplace": ("person", "city", "the birthplace of {}"),
    "employer": ("person", "company", "the employer of {}"),
    "headquarters": ("company", "city", "the headquarters city of {}"),
    "founder": ("company", "person", "the founder of {}"),
    "country": ("city", "country", "the country of {}"),
}
# attribute name -> (entity type, question template)
ATTRIBUTES = {
    "occupation": ("person", "What is the occupation of {}?"),
    "birth_year": ("person", "In which year was {} born?"),
    "river": ("city", "Which river flows through {}?"),
    "industry": ("company", "Which industry is {} in?"),
    "currency": ("country", "What is the currency of {}?"),
}

# attribute name -> the nouns an answer may name its value with (gold aliases): the documents' own
# ("the X river", "an X company") and the question's ("Which industry ...?")
ANSWER_NOUNS = {"river": ("river",), "industry": ("industry", "company")}


@dataclass
class Entity:
    id: str
    kind: str
    name: str
    attributes: dict[str, str] = field(default_factory=dict)
    relations: dict[str, str] = field(default_factory=dict)  # relation -> entity id


class _Names:
    """Unique made-up words from a seeded generator."""

    def __init__(self, rng: np.random.Generator):
        self.rng = rng
        self.used: set[str] = set()

    def word(self, syllables: int) -> str:
        while True:
            parts = [self.rng.choice(_ONSETS) + self.rng.choice(_VOWELS) for _ in range(syllables)]
            word = ("".join(parts) + self.rng.choice(_CODAS)).capitalize()
            if word not in self.used:
                self.used.add(word)
                return word


# Cities take one-syllable name suffixes, of which there are about 1,200: a larger world would
# run out of unused names.
MAX_PEOPLE = 2000


class World:
    def __init__(self, seed: int = 0, people: int = 30):
        if not 2 <= people <= MAX_PEOPLE:
            raise ConfigError(f"world_size must be at most {MAX_PEOPLE} (a larger generated world runs out of "
                              f"names) and at least 2, got {people}")
        rng = np.random.default_rng(seed)
        self.seed = seed
        self._names = names = _Names(rng)
        self.entities: dict[str, Entity] = {}

        def add(kind: str, name: str, **attributes: str) -> Entity:
            entity = Entity(f"{kind}-{sum(e.kind == kind for e in self.entities.values())}", kind, name, attributes)
            self.entities[entity.id] = entity
            return entity

        def pick(kind_entities: list[Entity]) -> str:
            return kind_entities[int(rng.integers(len(kind_entities)))].id

        # One invented word per currency: a shared word ("... crown") would give every currency
        # question partial token-F1 credit for answering that word alone.
        countries = [add("country", names.word(2), currency=f"{names.word(2).lower()}crown")
                     for _ in range(max(3, people // 8))]
        cities = [add("city", names.word(2) + names.word(1).lower(), river=names.word(2)) for _ in range(max(4, people // 3))]
        companies = [add("company", f"{names.word(2)} {rng.choice(_COMPANY_SUFFIXES)}",
                         industry=str(rng.choice(_INDUSTRIES))) for _ in range(max(3, people // 4))]
        persons = [add("person", f"{names.word(2)} {names.word(2)}", occupation=str(rng.choice(_OCCUPATIONS)),
                       birth_year=str(int(rng.integers(1900, 2000)))) for _ in range(people)]
        for city in cities:
            city.relations["country"] = pick(countries)
        for person in persons:
            person.relations["birthplace"] = pick(cities)
            person.relations["employer"] = pick(companies)
        for company in companies:
            company.relations["headquarters"] = pick(cities)
            company.relations["founder"] = pick(persons)
        self.documents = [Document(e.id, e.name, self._render(e)) for e in self.entities.values()]

    def _name(self, entity_id: str) -> str:
        return self.entities[entity_id].name

    def _render(self, e: Entity) -> str:
        a, r = e.attributes, e.relations
        if e.kind == "country":
            return f"{e.name} is a country. Its currency is the {a['currency']}."
        if e.kind == "city":
            return (f"{e.name} is a city in {self._name(r['country'])}. "
                    f"The {a['river']} river flows through {e.name}.")
        if e.kind == "company":
            industry = a["industry"]
            return (f"{e.name} is {_article(industry)} {industry} company headquartered in "
                    f"{self._name(r['headquarters'])}. It was founded by {self._name(r['founder'])}.")
        occupation = a["occupation"]
        return (f"{e.name} is {_article(occupation)} {occupation} born in {a['birth_year']} in "
                f"{self._name(r['birthplace'])}. {e.name} works for {self._name(r['employer'])}.")

    def question(self, rng: np.random.Generator, hops: int, answerable: bool = True) -> Question:
        """A question needing ``hops`` documents (or an unanswerable one of the same shape)."""
        if not 1 <= hops <= MAX_HOPS:
            raise ValueError(f"hops must be in [1, {MAX_HOPS}], got {hops!r}")
        persons = [e for e in self.entities.values() if e.kind == "person"]
        for _ in range(100):  # retry the rare walks that revisit an entity
            start = persons[int(rng.integers(len(persons)))]
            path = self._walk(rng, start, hops - 1)
            if path is not None:
                break
        else:  # pragma: no cover - a world of one person only
            raise RuntimeError("could not draw a question path; use a larger world")
        relations, entities = path
        end = entities[-1]
        attributes = [name for name, (kind, _) in ATTRIBUTES.items() if kind == end.kind]
        attribute = attributes[int(rng.integers(len(attributes)))]
        start_name = start.name if answerable else self._unknown_person(rng)
        description = start_name
        for relation in relations:
            description = RELATIONS[relation][2].format(description)
        text = ATTRIBUTES[attribute][1].format(description)
        if not answerable:
            return Question(f"world{self.seed}-unanswerable-{start_name.replace(' ', '_')}-{'-'.join(relations)}-{attribute}",
                            text, (), (), hops=hops, answerable=False)
        question_id = f"world{self.seed}-" + "-".join(e.id for e in entities) + f"-{attribute}"
        value = end.attributes[attribute]
        # The documents name a river and an industry with a noun ("the Brican river", "a mining
        # company"), so an answer in those words is right too: token F1 would give the bare name's gold
        # 0.67, under MemoryQA's threshold of 0.8, and an exact match 0.
        answers = (value, *(f"{value} {noun}" for noun in ANSWER_NOUNS.get(attribute, ())))
        return Question(question_id, text, answers, tuple(e.name for e in entities), hops=hops)

    def _walk(self, rng, start: Entity, steps: int) -> tuple[list[str], list[Entity]] | None:
        relations, entities = [], [start]
        for _ in range(steps):
            options = sorted(entities[-1].relations)
            if not options:
                return None
            relation = options[int(rng.integers(len(options)))]
            nxt = self.entities[entities[-1].relations[relation]]
            if nxt in entities:
                return None
            relations.append(relation)
            entities.append(nxt)
        return relations, entities

    def _unknown_person(self, rng: np.random.Generator) -> str:
        # A fresh name from the question's rng, checked against the world's names.
        names = _Names(rng)
        names.used = set(self._names.used)
        return f"{names.word(2)} {names.word(2)}"


def _article(word: str) -> str:
    """The indefinite article for ``word``: "an engineer", "a surgeon" (the world's words are
    plain English ones, so the first letter tells)."""
    return "an" if word[:1].lower() in "aeiou" else "a"
