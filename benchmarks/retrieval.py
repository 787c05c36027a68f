"""Retrieval speed and quality: rftgym's retrievers against rank-bm25, side by side in one run.

What is measured
----------------
* BM25 over a ``--docs`` (default 100,000) document corpus: our :class:`BM25Retriever` (bm25s,
  Lucene BM25, k1=1.5, b=0.75) against ``rank_bm25.BM25Okapi`` (same k1 and b). Index time,
  top-10 queries/s and the mean top-10 agreement of the two (overlap of their top-10 id sets).
  rank-bm25 scores every document in Python for each query, so it runs only the first
  ``--peer-queries`` queries; every rate is per query, so the rates compare directly.
* Dense: our :class:`DenseRetriever` (all-MiniLM-L6-v2 embeddings, FAISS flat inner-product
  index) over the first ``--dense-docs`` (default 10,000) documents of the same corpus:
  embedding passages with MiniLM on a 2-core CPU runs at ~10 passages/s, so 100k would take
  hours. The embeddings are cached on disk (keyed by the corpus contents), so reruns skip that
  step; the table says whether they came from the cache. Embedding time is reported apart from
  query time, and BM25 is also scored on the same prefix so the two compare on equal terms.
* Recall@10 on HotpotQA-100: a question's recall is the fraction of its supporting-fact titles
  among the titles of its top-10 hits. Measured on the questions' own 994-paragraph corpus (the
  union of their contexts) and inside the large corpus (BM25: all of it; dense: its subset).

Tokenization
------------
Both BM25 sides see the same tokens: ``bm25s.tokenize(..., stopwords="en")`` (lowercase, words of
2+ word characters, English stop words removed, no stemming) over ``"title\\ntext"``. Ours gets
token ids from it (what BM25Retriever does); rank-bm25 gets the token strings, and its index time
includes that tokenization. Scores still differ a little: Lucene's idf is
``log(1 + (N - n + .5) / (n + .5))``, rank-bm25's Okapi idf is ``log((N - n + .5) / (n + .5))``
with negative values raised to 0.25 x the mean idf, so rankings mostly, not always, agree.

How the 100k corpus is built (deterministic)
--------------------------------------------
From ``<data-dir>/qa/``: the base passages, in this order, are hotpotqa_100_corpus.json
(``{title: [sentences]}``, 994), 2wiki_corpus_6119.json (``[{title, text}]``, 6,119) and
wiki_1000.jsonl (FlashRAG, 1,000): 8,113 passages. Each is split into sentences (on ``. ! ?``
followed by a space and a capital, digit or quote). Variants are then added:

1. sentence windows: every run of 2 consecutive sentences of a passage with 3 or more, titled
   ``"<title> (excerpt j)"``;
2. recombinations: 3 sentences drawn from 3 different base passages, titled
   ``"<title a> / <title b> / <title c>"``, as many as needed to reach ``--docs``.

The variants are shuffled with ``numpy.random.default_rng(--seed)`` and appended after the base
passages, so the first documents are always the real passages (and every HotpotQA gold
paragraph is in any prefix of 994+ documents, the dense subset included). No variant's title
equals a real title, so "strict" recall counts only the real passages; "lenient" recall also
counts a variant built from a gold passage.

    python benchmarks/retrieval.py [--docs 100000] [--dense-docs 10000] [--peer-queries 20]

Prints tables, then (the last line) one JSON object with the headline figures.
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from rftgym.envs.search.corpora import Document, Question, load_corpus, load_hotpotqa_questions, load_nq_questions
from rftgym.envs.search.retrievers import (
    DEFAULT_DENSE_MODEL, BM25Retriever, DenseRetriever, corpus_fingerprint, embeddings_cache_dir,
    load_embedding_model,
)
from rftgym.rollout import format_table
from provenance import provenance_line

K = 10
SPEEDUP_TARGET = 40.0  # ours must answer >= 40x as many BM25 queries per second as rank-bm25
DEFAULT_DATA_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "data"
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'(])")


# ---------------------------------------------------------------- corpus


def load_base_documents(qa_dir: Path) -> list[Document]:
    """The real passages, ids prefixed by source (2Wiki and FlashRAG ids both start at 0)."""
    sources = [("hotpot", "hotpotqa_100_corpus.json"), ("2wiki", "2wiki_corpus_6119.json"),
               ("wiki", "wiki_1000.jsonl")]
    documents = []
    for prefix, name in sources:
        documents += [Document(f"{prefix}:{d.id}", d.title, d.text) for d in load_corpus(qa_dir / name)]
    return documents


def split_sentences(text: str) -> list[str]:
    return [s.strip() for s in SENTENCE_END.split(text) if s.strip()]


Variant = tuple[Document, tuple[str, ...], str]  # (document, titles of its real sources, kind)


def sentence_windows(base: list[Document], sentences: list[list[str]]) -> list[Variant]:
    """Every 2-sentence window of each passage that has 3+ sentences (so no window is the whole)."""
    variants = []
    for document, parts in zip(base, sentences):
        if len(parts) < 3:
            continue
        for j in range(len(parts) - 1):
            text = " ".join(parts[j:j + 2])
            variants.append((Document("", f"{document.title} (excerpt {j + 1})", text), (document.title,),
                             "sentence windows"))
    return variants


def recombinations(base: list[Document], sentences: list[list[str]], count: int,
                   rng: np.random.Generator) -> list[Variant]:
    """``count`` passages of 3 sentences, each from a different random base passage."""
    usable = [i for i, parts in enumerate(sentences) if parts]
    variants = []
    for _ in range(count):
        picks = rng.choice(usable, size=3, replace=False)
        titles = tuple(base[i].title for i in picks)
        text = " ".join(sentences[i][rng.integers(len(sentences[i]))] for i in picks)
        variants.append((Document("", " / ".join(titles), text), titles, "recombinations"))
    return variants


def build_corpus(base: list[Document], n_docs: int, seed: int) -> tuple[list[Document], dict[str, tuple[str, ...]], dict]:
    """``n_docs`` documents: the base passages first, then shuffled seeded variants.

    Also returns, for each document id, the titles of the real passages it was built from (for
    lenient recall), and how many documents of each kind the corpus holds.
    """
    rng = np.random.default_rng(seed)
    sentences = [split_sentences(d.text) for d in base]
    variants = sentence_windows(base, sentences)
    variants += recombinations(base, sentences, max(0, n_docs - len(base) - len(variants)), rng)
    order = rng.permutation(len(variants))
    variants = [variants[i] for i in order[:max(0, n_docs - len(base))]]

    documents = list(base[:n_docs])
    sources = {d.id: (d.title,) for d in documents}
    kinds = {"real passages": len(documents), "sentence windows": 0, "recombinations": 0}
    for number, (variant, titles, kind) in enumerate(variants):
        document = Document(f"variant:{number}", variant.title, variant.text)
        documents.append(document)
        sources[document.id] = titles
        kinds[kind] += 1
    return documents, sources, kinds


# ---------------------------------------------------------------- measuring


def timed(function: Callable, *args, **kwargs):
    started = time.perf_counter()
    result = function(*args, **kwargs)
    return result, time.perf_counter() - started


def median_time(function: Callable, repeats: int):
    """The result of the last run and the median wall time over ``repeats`` runs (the machine is
    shared, so one run can be slowed by other work; the median is steadier than one sample)."""
    times = []
    for _ in range(repeats):
        result, elapsed = timed(function)
        times.append(elapsed)
    return result, float(np.median(times))


def top_k_agreement(ours: Sequence[Sequence[str]], peer: Sequence[Sequence[str]]) -> float:
    """Mean over queries of |ours ∩ peer| / max(|ours|, |peer|) for the two top-k id lists."""
    overlaps = [len(set(a) & set(b)) / max(len(a), len(b), 1) for a, b in zip(ours, peer)]
    return float(np.mean(overlaps))


def recall_at_k(questions: Sequence[Question], hit_titles: Sequence[Sequence[tuple[str, ...]]]) -> float:
    """Mean fraction of each question's gold titles found among its hits' titles.

    ``hit_titles[q]`` holds, per hit, the titles that hit counts as (one for a real passage)."""
    recalls = []
    for question, hits in zip(questions, hit_titles):
        if not question.gold_titles:
            continue
        found = {title for titles in hits for title in titles}
        recalls.append(sum(t in found for t in question.gold_titles) / len(question.gold_titles))
    return float(np.mean(recalls))


def strict_and_lenient_recall(questions, results, sources) -> tuple[float, float]:
    strict = recall_at_k(questions, [[(hit.title,) for hit in hits] for hits in results])
    lenient = recall_at_k(questions, [[sources[hit.doc_id] for hit in hits] for hits in results])
    return strict, lenient


# ---------------------------------------------------------------- BM25


def import_bm25_libraries() -> None:
    """Import bm25s and rank_bm25 before any timing, so neither side's index time pays for it."""
    import bm25s  # noqa: F401
    import rank_bm25  # noqa: F401


def bench_ours_bm25(documents: list[Document], queries: list[str], repeats: int) -> dict:
    retriever, index_s = timed(BM25Retriever, documents)
    results, batch_s = median_time(lambda: retriever.search(queries, K), repeats)
    _, single_s = median_time(lambda: [retriever.search([q], K) for q in queries], repeats)
    return {"retriever": retriever, "index_s": index_s, "results": results,
            "qps": len(queries) / batch_s, "qps_single": len(queries) / single_s}


def bench_rank_bm25(documents: list[Document], queries: list[str]) -> dict:
    """rank-bm25 on the same tokens; top-k by a partial sort of its full score vector."""
    import bm25s
    from rank_bm25 import BM25Okapi

    def build():
        corpus = [f"{d.title}\n{d.text}" for d in documents]
        return BM25Okapi(bm25s.tokenize(corpus, stopwords="en", show_progress=False, return_ids=False),
                         k1=1.5, b=0.75)

    def search(query: str) -> list[str]:
        tokens = bm25s.tokenize([query], stopwords="en", show_progress=False, return_ids=False)[0]
        scores = index.get_scores(tokens)
        top = np.argpartition(-scores, K)[:K]
        top = top[np.argsort(-scores[top])]
        return [documents[i].id for i in top if scores[i] > 0]  # ours also drops zero scores

    index, index_s = timed(build)
    ids, query_s = timed(lambda: [search(q) for q in queries])
    return {"index_s": index_s, "ids": ids, "qps": len(queries) / query_s}


# ---------------------------------------------------------------- dense


def embeddings_cached(documents: list[Document]) -> bool:
    return (embeddings_cache_dir() / f"{corpus_fingerprint(documents, DEFAULT_DENSE_MODEL)}.npy").is_file()


def bench_dense(documents: list[Document], queries: list[str], repeats: int) -> dict:
    cached = embeddings_cached(documents)
    retriever, embed_s = timed(DenseRetriever, documents)  # the model is already loaded
    results, query_s = median_time(lambda: retriever.search(queries, K), repeats)
    vectors = retriever._encode(queries)
    _, faiss_s = median_time(lambda: retriever.index.search(vectors, K), repeats)
    retriever.close()
    return {"embed_s": embed_s, "cached": cached, "results": results,
            "qps": len(queries) / query_s, "faiss_qps": len(queries) / faiss_s}


# ---------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR,
                        help="the shared data folder (holding qa/); default: ../shared/data beside the repo")
    parser.add_argument("--docs", type=int, default=100_000, help="documents in the BM25 corpus")
    parser.add_argument("--dense-docs", type=int, default=10_000,
                        help="the first this many documents form the dense index (0: skip dense)")
    parser.add_argument("--peer-queries", type=int, default=20, help="queries rank-bm25 runs")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of our queries (median)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the corpus variants")
    return parser.parse_args()


def qps(value: float) -> str:
    return f"{value:,.1f}"


def main() -> None:
    args = parse_args()
    print(provenance_line(), flush=True)
    qa_dir = args.data_dir / "qa"
    base = load_base_documents(qa_dir)
    documents, sources, kinds = build_corpus(base, args.docs, args.seed)
    hotpot = load_hotpotqa_questions(qa_dir / "hotpotqa_100.json")
    nq = load_nq_questions(qa_dir / "nq_16.jsonl")
    queries = [q.question for q in hotpot] + [q.question for q in nq]
    peer_queries = queries[:args.peer_queries]
    print(f"corpus: {len(documents):,} documents ("
          + ", ".join(f"{n:,} {kind}" for kind, n in kinds.items()) + f"; seed {args.seed})")
    print(f"queries: {len(queries)} ({len(hotpot)} HotpotQA + {len(nq)} NQ); "
          f"rank-bm25 runs the first {len(peer_queries)}\n")

    # ---- BM25: ours vs rank-bm25
    import_bm25_libraries()
    ours = bench_ours_bm25(documents, queries, args.repeats)
    peer = bench_rank_bm25(documents, peer_queries)
    gc.collect()  # rank-bm25's per-document dicts are large; free them before the dense part
    agreement = top_k_agreement([[h.doc_id for h in hits] for hits in ours["results"][:len(peer_queries)]],
                                peer["ids"])
    speedup, speedup_single = ours["qps"] / peer["qps"], ours["qps_single"] / peer["qps"]
    print(f"BM25, top-{K}, {len(documents):,} documents (bm25s tokens, English stop words; 1 thread each)")
    rows = [
        ["rftgym BM25Retriever (bm25s)", f"{ours['index_s']:.2f}", len(queries), qps(ours["qps"]),
         qps(ours["qps_single"]), f"{speedup:.1f}x / {speedup_single:.1f}x"],
        ["rank_bm25.BM25Okapi", f"{peer['index_s']:.2f}", len(peer_queries), "-", qps(peer["qps"]), "1.0x"],
    ]
    print(format_table(rows, ["retriever", "index s", "queries", "q/s batched", "q/s one at a time",
                              "speedup (batched / one at a time)"]))
    verdict = "met" if min(speedup, speedup_single) >= SPEEDUP_TARGET else "NOT met"
    print(f"target >= {SPEEDUP_TARGET:.0f}x rank-bm25's queries/s: {verdict}; "
          f"top-{K} agreement on the {len(peer_queries)} shared queries: {agreement:.3f}\n")

    # ---- Dense and recall
    own_corpus = load_corpus(qa_dir / "hotpotqa_100.json")
    hotpot_queries = [q.question for q in hotpot]
    own_bm25 = BM25Retriever(own_corpus).search(hotpot_queries, K)
    recall = {"bm25_own": recall_at_k(hotpot, [[(h.title,) for h in hits] for hits in own_bm25])}
    recall["bm25_large"] = strict_and_lenient_recall(hotpot, ours["results"][:len(hotpot)], sources)

    dense = dense_own = None
    if args.dense_docs > 0:
        _, model_s = timed(load_embedding_model)
        subset = documents[:args.dense_docs]
        dense = bench_dense(subset, queries, args.repeats)
        dense_own = bench_dense(own_corpus, hotpot_queries, 1)
        recall["dense_own"] = recall_at_k(hotpot, [[(h.title,) for h in hits] for hits in dense_own["results"]])
        recall["dense_large"] = strict_and_lenient_recall(hotpot, dense["results"][:len(hotpot)], sources)
        # BM25 on the dense subset too, so the two retrievers also compare on the same documents.
        prefix_bm25 = BM25Retriever(subset).search(hotpot_queries, K)
        recall["bm25_prefix"] = strict_and_lenient_recall(hotpot, prefix_bm25, sources)
        print(f"Dense ({DEFAULT_DENSE_MODEL}, FAISS IndexFlatIP), top-{K}, the first {len(subset):,} of the "
              f"{len(documents):,} documents (--dense-docs); model load {model_s:.1f} s")
        rows = [[f"{len(subset):,} docs (large corpus prefix)", f"{dense['embed_s']:.1f}",
                 "yes" if dense["cached"] else "no", len(queries), qps(dense["qps"]), qps(dense["faiss_qps"])],
                [f"{len(own_corpus):,} docs (HotpotQA-100 own)", f"{dense_own['embed_s']:.1f}",
                 "yes" if dense_own["cached"] else "no", len(hotpot), qps(dense_own["qps"]),
                 qps(dense_own["faiss_qps"])]]
        print(format_table(rows, ["index", "embed s", "from cache", "queries", "q/s (encode + search)",
                                  "q/s (FAISS search only)"]))
        print()

    print(f"Recall@{K} of HotpotQA-100 supporting-fact titles ({len(hotpot)} questions; "
          "strict: the real passage; lenient: or a variant built from it)")
    rows = [["BM25", f"{len(own_corpus):,} (own)", f"{recall['bm25_own']:.3f}", "-"],
            ["BM25", f"{len(documents):,} (large)", f"{recall['bm25_large'][0]:.3f}", f"{recall['bm25_large'][1]:.3f}"]]
    if dense is not None:
        rows += [["BM25", f"{len(subset):,} (large prefix)", f"{recall['bm25_prefix'][0]:.3f}",
                  f"{recall['bm25_prefix'][1]:.3f}"],
                 ["dense", f"{len(own_corpus):,} (own)", f"{recall['dense_own']:.3f}", "-"],
                 ["dense", f"{len(subset):,} (large prefix)", f"{recall['dense_large'][0]:.3f}",
                  f"{recall['dense_large'][1]:.3f}"]]
    print(format_table(rows, ["retriever", "corpus docs", "recall strict", "recall lenient"]))

    headline = {
        "bench": "retrieval", "docs": len(documents), "queries": len(queries), "peer_queries": len(peer_queries),
        "ours_bm25_index_s": round(ours["index_s"], 3), "rank_bm25_index_s": round(peer["index_s"], 3),
        "ours_bm25_qps": round(ours["qps"], 2), "ours_bm25_qps_single": round(ours["qps_single"], 2),
        "rank_bm25_qps": round(peer["qps"], 3), "bm25_speedup": round(speedup, 1),
        "bm25_speedup_single": round(speedup_single, 1), "bm25_speedup_target": SPEEDUP_TARGET,
        "bm25_top10_agreement": round(agreement, 4),
        "recall10_bm25_own": round(recall["bm25_own"], 4), "recall10_bm25_large": round(recall["bm25_large"][0], 4),
        "recall10_bm25_large_lenient": round(recall["bm25_large"][1], 4),
    }
    if dense is not None:
        headline.update({
            "dense_docs": len(subset), "dense_embed_s": round(dense["embed_s"], 2),
            "dense_embed_cached": dense["cached"], "dense_qps": round(dense["qps"], 2),
            "faiss_qps": round(dense["faiss_qps"], 1), "recall10_dense_own": round(recall["dense_own"], 4),
            "recall10_dense_large": round(recall["dense_large"][0], 4),
            "recall10_dense_large_lenient": round(recall["dense_large"][1], 4),
            "recall10_bm25_dense_prefix": round(recall["bm25_prefix"][0], 4),
        })
    print(json.dumps(headline))


if __name__ == "__main__":
    main()
