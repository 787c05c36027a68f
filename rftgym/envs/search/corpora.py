"""Corpora and question sets for retrieval QA, read from the standard public formats.

Corpora (:func:`load_corpus` picks the loader from the file's shape):

* HotpotQA JSON: a list of ``{_id, question, answer, context: [[title, [sentences]]], ...}``;
  the union of the questions' contexts is the corpus (one document per distinct title).
* ``{title: [sentences]}`` JSON (HippoRAG's ``*_corpus.json``).
* ``[{title, text}]`` JSON (2WikiMultihopQA corpora).
* FlashRAG JSONL: one ``{id, contents}`` per line, ``contents = '"Title"\\ntext'``.
* MuSiQue-style JSONL: one ``{id, question, answer, paragraphs: [{title, paragraph_text}]}`` per
  line; the union of the paragraphs is the corpus.

Questions: HotpotQA JSON (:func:`load_hotpotqa_questions`), NQ-style JSONL ``{question,
golden_answers}`` (:func:`load_nq_questions`) and MuSiQue-style JSONL
(:func:`load_musique_questions`). :func:`load_questions` picks one from the file's shape.

A file that does not have the expected shape raises :class:`DataFormatError` naming the file,
the line (for JSONL) or record, and the shape that was expected.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...core.errors import ConfigError, DataFormatError
from ...core.jsonl import is_jsonl, read_json, read_jsonl
from ...core.values import valid_text


@dataclass(frozen=True)
class Document:
    id: str
    title: str
    text: str

    def __post_init__(self) -> None:
        # Data files may escape lone surrogates in JSON (some Wikipedia dumps do): valid there, but
        # no tokenizer or encoder takes them, in a search result or in the dense index alike.
        for name in ("id", "title", "text"):  # a title may be the id too (HotpotQA's)
            value = getattr(self, name)
            if isinstance(value, str):
                object.__setattr__(self, name, valid_text(value))


@dataclass(frozen=True)
class Question:
    id: str
    question: str
    answers: tuple[str, ...]  # any of them is right; empty for an unanswerable question
    gold_titles: tuple[str, ...] = ()  # titles of the documents that hold the evidence
    hops: int = 0  # 0 when unknown (datasets without a hop count)
    answerable: bool = True


HOTPOTQA_SHAPE = "a JSON list of HotpotQA records {_id, question, answer, context: [[title, [sentences]]]}"
TITLE_SENTENCES_SHAPE = "a JSON object {title: [sentences]}"
TITLE_TEXT_SHAPE = "a JSON list of {title, text} objects"
FLASHRAG_SHAPE = 'JSONL lines {"id": ..., "contents": "\\"Title\\"\\ntext"}'
NQ_SHAPE = 'JSONL lines {"question": str, "golden_answers": [str, ...]} (or NQ-open\'s "answer"; optionally "id")'
MUSIQUE_SHAPE = 'JSONL lines {"id", "question", "answer", "paragraphs": [{"title", "paragraph_text"}]}'


def _is_str_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(s, str) for s in value)


# What a data file given in the other one's place is told: the envs read questions from
# dataset_path and a corpus from corpus_path.
AS_CORPUS = (" (this is a corpus, not questions: an env reads a corpus from corpus_path, its questions from "
             "dataset_path)")
AS_QUESTIONS = (" (this holds questions, not documents: an env reads its questions from dataset_path, a corpus from "
                "corpus_path)")


def _looks_like_corpus(data: Any) -> bool:
    """A {title: [sentences]} or [{title, text}] corpus, by its first entry."""
    if isinstance(data, dict):
        return bool(data) and _is_str_list(next(iter(data.values())))
    return isinstance(data, list) and bool(data) and isinstance(data[0], dict) and "question" not in data[0] \
        and isinstance(data[0].get("title"), str) and isinstance(data[0].get("text"), str)


# ---------------------------------------------------------------- corpora


def _hotpotqa_records(path: Path, data: Any = None) -> list[dict]:
    """The records of a HotpotQA file, checked; ``data``: the file, when already parsed."""
    data = read_json(path, HOTPOTQA_SHAPE) if data is None else data
    if _looks_like_corpus(data):
        raise DataFormatError(f"{path}: expected {HOTPOTQA_SHAPE}, got a corpus of "
                              f"{'{title: [sentences]}' if isinstance(data, dict) else '{title, text} records'}"
                              f"{AS_CORPUS}")
    if not isinstance(data, list):
        lines = (" (a JSON-lines record? a JSON-lines file is read as such when its name ends in .jsonl)"
                 if isinstance(data, dict) and "question" in data else "")
        raise DataFormatError(f"{path}: expected {HOTPOTQA_SHAPE}, got a JSON {type(data).__name__}{lines}")
    for index, record in enumerate(data):
        where = f"{path}: record {index}"
        if not isinstance(record, dict) or not isinstance(record.get("question"), str) \
                or not isinstance(record.get("answer"), str) or not isinstance(record.get("context"), list):
            nq = isinstance(record, dict) and "context" not in record and (
                "golden_answers" in record or isinstance(record.get("answer"), list))
            raise DataFormatError(f"{where}: " + (
                f"an NQ-style question (answers, no context): such questions are read from a JSON-lines "
                f"file, one record per line, named .jsonl; expected {NQ_SHAPE}" if nq else
                f"needs string 'question' and 'answer' and a list 'context'; expected {HOTPOTQA_SHAPE}"))
        for item in record["context"]:
            if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str) and _is_str_list(item[1])):
                raise DataFormatError(f"{where}: each context item must be [title, [sentences]]; "
                                      f"expected {HOTPOTQA_SHAPE}")
    return data


def _hotpotqa_corpus(path: Path, data: Any = None) -> list[Document]:
    """One document per distinct paragraph: a title's repeats are the same paragraph (kept once,
    id = the title), but a paragraph of another text under a title already seen (two questions'
    contexts that disagree) is another document, ``title#2`` and on, so no question loses its
    evidence."""
    documents: dict[tuple[str, str], Document] = {}
    per_title: dict[str, int] = {}
    for record in _hotpotqa_records(path, data):
        for title, sentences in record["context"]:
            text = "".join(sentences).strip()
            if (title, text) not in documents:
                per_title[title] = per_title.get(title, 0) + 1
                doc_id = title if per_title[title] == 1 else f"{title}#{per_title[title]}"
                documents[(title, text)] = Document(doc_id, title, text)
    return list(documents.values())


def _title_sentences_corpus(path: Path, data: dict) -> list[Document]:
    documents = []
    for title, sentences in data.items():
        if not _is_str_list(sentences):
            raise DataFormatError(f"{path}: entry {title!r} is not a list of sentences; expected {TITLE_SENTENCES_SHAPE}")
        documents.append(Document(title, title, "".join(sentences).strip()))
    return documents


def _title_text_corpus(path: Path, data: list) -> list[Document]:
    documents = []
    for index, record in enumerate(data):
        if not (isinstance(record, dict) and isinstance(record.get("title"), str) and isinstance(record.get("text"), str)):
            raise DataFormatError(f"{path}: record {index} is not {{title, text}} strings; expected {TITLE_TEXT_SHAPE}")
        # Titles repeat in some corpora (2Wiki), so the id is the record's position.
        documents.append(Document(_record_id(record, index, f"{path}: record {index}"), record["title"],
                                  record["text"]))
    return documents


def split_flashrag_contents(contents: str) -> tuple[str, str]:
    """('Title', 'text') from FlashRAG's ``'"Title"\\ntext'`` (no title when there is no newline)."""
    first, newline, rest = contents.partition("\n")
    if not newline:
        return "", contents
    first = first.strip()
    if len(first) >= 2 and first[0] == first[-1] == '"':  # one pair: a title may be quoted itself
        first = first[1:-1]
    return first, rest


def _flashrag_corpus(path: Path, limit: int | None = None) -> list[Document]:
    documents = []
    for number, record in read_jsonl(path, FLASHRAG_SHAPE):
        if not isinstance(record.get("contents"), str) or "id" not in record:
            hint = AS_QUESTIONS if "question" in record and "contents" not in record else ""
            raise DataFormatError(f"{path}:{number}: needs 'id' and a string 'contents'{hint}; expected "
                                  f"{FLASHRAG_SHAPE}")
        title, text = split_flashrag_contents(record["contents"])
        documents.append(Document(_record_id(record, None, f"{path}:{number}"), title, text))
        if len(documents) == limit:
            break
    return documents


def _musique_corpus(path: Path, limit: int | None = None) -> list[Document]:
    documents: dict[tuple[str, str], Document] = {}
    for number, record in read_jsonl(path, MUSIQUE_SHAPE):
        for paragraph in _musique_paragraphs(path, number, record):
            key = (paragraph["title"], paragraph["paragraph_text"])
            documents.setdefault(key, Document(str(len(documents)), *key))
        if limit is not None and len(documents) >= limit:
            break
    return list(documents.values())[:limit]


def _musique_paragraphs(path: Path, number: int, record: dict) -> list[dict]:
    paragraphs = record.get("paragraphs")
    if not isinstance(paragraphs, list) or not all(
            isinstance(p, dict) and isinstance(p.get("title"), str) and isinstance(p.get("paragraph_text"), str)
            for p in paragraphs):
        raise DataFormatError(f"{path}:{number}: 'paragraphs' must be a list of {{title, paragraph_text}}; "
                              f"expected {MUSIQUE_SHAPE}")
    return paragraphs


def load_corpus(path: str | os.PathLike, limit: int | None = None) -> list[Document]:
    """Documents from any of the supported corpus formats (see the module docstring); with
    ``limit``, the first ``limit`` of them, and a JSON-lines file is read no further than that
    (a distractor corpus may be a whole encyclopedia)."""
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise ConfigError(f"limit must be a positive int or None, got {limit!r}")
    path = Path(path)
    by_position = False  # whether a document without an id of its own takes its position
    if is_jsonl(path):
        first = next(read_jsonl(path, f"{FLASHRAG_SHAPE} or {MUSIQUE_SHAPE}"), None)
        if first is None:
            raise DataFormatError(f"{path}: the file is empty; expected {FLASHRAG_SHAPE}")
        documents = _musique_corpus(path, limit) if "paragraphs" in first[1] else _flashrag_corpus(path, limit)
    else:
        shapes = f"{HOTPOTQA_SHAPE}, {TITLE_SENTENCES_SHAPE} or {TITLE_TEXT_SHAPE}"
        data = read_json(path, shapes)
        if isinstance(data, dict):
            documents = _title_sentences_corpus(path, data)
        elif isinstance(data, list) and data and isinstance(data[0], dict) and ("context" in data[0]
                                                                              or "question" in data[0]):
            # HotpotQA records (one without a context is reported as such, not as a bad {title, text})
            documents = _hotpotqa_corpus(path, data)
        elif isinstance(data, list):
            documents, by_position = _title_text_corpus(path, data), True
        else:
            raise DataFormatError(f"{path}: got a JSON {type(data).__name__}; expected {shapes}")
        documents = documents[:limit]
    if not documents:
        raise DataFormatError(f"{path}: the corpus has no documents")
    _refuse_repeated_ids(path, "document", [d.id for d in documents],
                         "a search result names its document by id (and MemoryQA prunes by it)",
                         by_position)
    return documents


def _refuse_repeated_ids(path: Path, kind: str, ids: list[str], why: str, by_position: bool = True) -> None:
    """``by_position``: whether a record without an id of its own is named by its position here."""
    counts = Counter(ids)
    repeated = [(i, n) for i, n in counts.items() if n > 1]
    if repeated:
        shown = ", ".join(f"{i!r} ({n} times)" for i, n in repeated[:3])
        more = f" and {len(repeated) - 3} more" if len(repeated) > 3 else ""
        implicit = " (a record without an 'id', HotpotQA's '_id', is named by its position)" if by_position else ""
        raise DataFormatError(f"{path}: {kind} ids must be unique ({why}), but {shown}{more} repeat{implicit}; remove "
                              "the repeats or give each its own id")


def _record_id(record: dict, position: int | None, where: str) -> str:
    """A record's 'id' as a string; without one, its ``position``. A null, boolean or nested id
    would be read as "None", "True" or a dict's text and match nothing a user writes."""
    if "id" not in record and position is not None:
        return str(position)
    value = record.get("id")
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise DataFormatError(f"{where}: 'id' is {value!r}; give a string or an integer"
                              + (" or leave it out" if position is not None else ""))
    return str(value)


# ---------------------------------------------------------------- questions


def _gold_answers(where: str, answers: tuple[str, ...]) -> tuple[str, ...]:
    """``answers`` without those that are empty once normalized (an alias "A": a reply that says
    nothing once normalized, "the" or "!!", would match it as well as the answer does); a record
    left with none is refused."""
    from .scoring import normalize_answer

    kept = tuple(a for a in answers if normalize_answer(a))
    if not kept:
        shown = ", ".join(repr(a) for a in answers)
        raise DataFormatError(f"{where}: the gold answer {shown} is empty once normalized (case, punctuation and "
                              "articles removed), so a reply saying nothing, such as 'the' or '!!', would match it as well as the "
                              "answer; fix or drop this record")
    return kept


def load_hotpotqa_questions(path: str | os.PathLike) -> list[Question]:
    path = Path(path)
    questions = []
    for index, record in enumerate(_hotpotqa_records(path)):
        where = f"{path}: record {index}"
        facts = record.get("supporting_facts") or []
        if not isinstance(facts, list) or not all(isinstance(f, list) and f and isinstance(f[0], str) for f in facts):
            raise DataFormatError(f"{where}: 'supporting_facts' must be a list of [title, sentence index] pairs, "
                                  f"got {str(facts)[:80]}")
        titles = tuple(dict.fromkeys(f[0] for f in facts))
        record_id = record.get("_id")
        if record_id is not None and (isinstance(record_id, bool) or not isinstance(record_id, (str, int))):
            raise DataFormatError(f"{where}: '_id' is {record_id!r}; give a string or an integer, or leave it out")
        questions.append(Question(str(index if record_id is None else record_id), record["question"],
                                  _gold_answers(where, (record["answer"],)), titles, hops=len(titles)))
    return questions


def load_nq_questions(path: str | os.PathLike) -> list[Question]:
    path = Path(path)
    questions = []
    for number, record in read_jsonl(path, NQ_SHAPE):
        # FlashRAG's (Search-R1's) key, or NQ-open's own.
        key = "golden_answers" if "golden_answers" in record or "answer" not in record else "answer"
        answers = record.get(key)
        if not isinstance(record.get("question"), str) or not _is_str_list(answers) or not answers:
            odd = next((f"; {key}[{i}] is {a!r}" for i, a in enumerate(answers) if not isinstance(a, str)), "") \
                if isinstance(answers, list) else ""
            hint = AS_CORPUS if "contents" in record and "question" not in record else ""
            raise DataFormatError(f"{path}:{number}: needs a string 'question' and a non-empty list of strings "
                                  f"'golden_answers' (or NQ-open's 'answer'){odd}{hint}; expected {NQ_SHAPE}")
        questions.append(Question(_record_id(record, number, f"{path}:{number}"), record["question"],
                                  _gold_answers(f"{path}:{number}", tuple(answers))))
    return questions


def load_musique_questions(path: str | os.PathLike) -> list[Question]:
    path = Path(path)
    questions = []
    for number, record in read_jsonl(path, MUSIQUE_SHAPE):
        answer = record.get("answer")
        aliases = record.get("answer_aliases") or []
        if not isinstance(record.get("question"), str) or not isinstance(answer, str) or not _is_str_list(aliases):
            raise DataFormatError(f"{path}:{number}: needs string 'question' and 'answer' (and 'answer_aliases', if "
                                  f"given, a list of strings); expected {MUSIQUE_SHAPE}")
        paragraphs = _musique_paragraphs(path, number, record)
        for name, value in [("answerable", record.get("answerable", True)),
                            *((f"paragraphs[{i}].is_supporting", p.get("is_supporting", False))
                              for i, p in enumerate(paragraphs))]:
            if not isinstance(value, bool):  # a string "false" would read as true
                raise DataFormatError(f"{path}:{number}: '{name}' must be true or false (a JSON boolean), got "
                                      f"{value!r}; expected {MUSIQUE_SHAPE}")
        gold = tuple(p["title"] for p in paragraphs if p.get("is_supporting"))
        answerable = record.get("answerable", True)
        answers = _gold_answers(f"{path}:{number}", (answer, *aliases)) if answerable else ()
        questions.append(Question(_record_id(record, number, f"{path}:{number}"), record["question"], answers, gold,
                                  hops=len(gold),
                                  answerable=answerable))
    twins = {q.id for q in questions if not q.answerable} & {q.id for q in questions if q.answerable}
    if twins:
        # MuSiQue-Full pairs each question with an unanswerable twin of the same id whose paragraphs
        # lack the evidence. Here every record's paragraphs join one corpus, in which the twin's
        # evidence is found through its pair: it would not be unanswerable.
        raise DataFormatError(f"{path}: {len(twins)} question ids (e.g. {sorted(twins)[0]!r}) are each given once "
                              "answerable and once unanswerable, as MuSiQue-Full pairs them. Every record's paragraphs "
                              "join one corpus here, where an unanswerable twin's evidence is found through its pair; "
                              "load the answerable file (MuSiQue-Ans: musique_ans_*.jsonl)")
    return questions


def load_questions(path: str | os.PathLike) -> list[Question]:
    """Questions from HotpotQA JSON, NQ-style JSONL or MuSiQue-style JSONL (chosen by shape)."""
    path = Path(path)
    if is_jsonl(path):
        first = next(read_jsonl(path, f"{NQ_SHAPE} or {MUSIQUE_SHAPE}"), None)
        if first is not None and "paragraphs" in first[1]:
            questions = load_musique_questions(path)
        else:
            questions = load_nq_questions(path)
    else:
        questions = load_hotpotqa_questions(path)
    if not questions:
        raise DataFormatError(f"{path}: the file holds no questions")
    blank = next((q for q in questions if not q.question.strip()), None)
    if blank is not None:
        raise DataFormatError(f"{path}: question {blank.id!r} is blank; give each record its question's text, or "
                              "drop the record")
    _refuse_repeated_ids(path, "question", [q.id for q in questions], "an episode names its task by id")
    return questions


def has_own_corpus(path: str | os.PathLike) -> bool:
    """Whether a question file carries its own paragraphs (HotpotQA contexts, MuSiQue paragraphs)."""
    path = Path(path)
    if not is_jsonl(path):
        return True
    first = next(read_jsonl(path, f"{NQ_SHAPE} or {MUSIQUE_SHAPE}"), None)
    return first is not None and "paragraphs" in first[1]
