"""Retrieval QA: corpora, retrievers, the SearchEvalQA environment and the retrieval service."""

from .corpora import Document, Question, load_corpus, load_questions
from .retrievers import BM25Retriever, CallableRetriever, DenseRetriever, Hit, Retriever, make_retriever

__all__ = ["Document", "Question", "load_corpus", "load_questions", "Hit", "Retriever", "BM25Retriever",
           "DenseRetriever", "CallableRetriever", "make_retriever"]
