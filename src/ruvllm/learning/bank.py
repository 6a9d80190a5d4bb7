"""The pattern bank: the feedback examples a tenant gave (prompt, target, score), each with an
embedding from the model's own hidden states, kept in SQLite; nearest neighbours through a faiss
index; near-duplicates grouped into clusters so the deep loop trains on one example per cluster.

Why faiss (faiss-cpu): a well-kept library with wheels for every platform we run on, exact inner-
product search (IndexFlatIP over unit vectors: cosine) that is fast at the bank's size (thousands of
examples a tenant) and approximate indexes when it grows. sqlite-vec would keep the vectors inside
SQLite, but it is a loadable extension and Python builds without `enable_load_extension` (this
machine's among them) cannot load it; hnswlib ships no wheels for every Python we support.
SQLite stays the store of record; the index is rebuilt from it per tenant when first searched.

The embedding (PromptEmbedder): the model's own hidden states entering the learned layers, averaged
over the rows that make a prompt what it is, less what every prompt shares. The plain mean over the
prompt made every pair of prompts alike at cosine 0.998-1.000 on the default model (the first
row's state is ~50x the others' in norm, and the chat template's two dozen rows are every chat
prompt's), so every example of a tenant joined one cluster and the deep loop trained on one
(session 26; docs/learning.md, "The pattern bank's embedding").
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

_SCHEMA = """
CREATE TABLE IF NOT EXISTS examples (
    id INTEGER PRIMARY KEY, tenant TEXT NOT NULL, time REAL NOT NULL, score REAL NOT NULL,
    prompt BLOB NOT NULL, target BLOB NOT NULL, embedding BLOB NOT NULL, cluster INTEGER);
CREATE INDEX IF NOT EXISTS examples_tenant ON examples (tenant);
"""


# A neutral sentence whose states stand for what every prompt shares where the prompt has no rows
# of its own to set apart (a prompt without the chat template's frame): PromptEmbedder.neutral.
_NEUTRAL = ("The weather was mild that spring, and the village held its market every Thursday. People came "
            "from the hills to sell cheese, wool and honey, and the children ran between the stalls.")


@dataclass(frozen=True)
class PromptEmbedder:
    """A prompt's embedding for the bank, from the hidden states `h` [P, H] entering the learned
    layers over its P tokens: the mean over its own rows less the mean state of what prompts share.
    Its own rows: those between the chat template's frame (`frame`: the template rendered around one
    user message, as token ids; its head and tail are found in the prompt as the longest common
    prefix and suffix), never the first row (whose state is ~50x the others' in norm). What prompts
    share: the frame's rows of the prompt itself where it has them, else `neutral`, the neutral
    sentence's mean state (computed once, for_model).

    Measured on the default model (session 26, 14 questions in 9 groups of the same meaning):
    paraphrases 0.83-0.96 (mean 0.87), different questions at most 0.946 (mean 0.70; "What is the
    capital of France?" against "... of Azrael?"), against 0.998-1.000 for all of them before; the
    bank's duplicate bound (0.95) keeps different questions apart and the same prompt together."""

    frame: list[int] | None
    neutral: torch.Tensor

    @classmethod
    def for_model(cls, tokenizer, hidden) -> PromptEmbedder:  # noqa: ANN001
        """`hidden(ids)`: the states entering the learned layers [T, H] (tail.hidden_before)."""
        from ruvllm.engine.prompts import has_chat_template, render_chat

        frame = render_chat(tokenizer, [{"role": "user", "content": "\u2063"}]) if has_chat_template(tokenizer) \
            else None
        ids = list(tokenizer.encode(_NEUTRAL, add_special_tokens=False))
        return cls(frame, hidden(ids)[1:].mean(dim=0))

    def span(self, prompt: list[int]) -> tuple[int, int]:
        """The prompt's own rows [start, end): within the frame's head and tail, from the second row."""
        n, start, tail = len(prompt), 0, 0
        if self.frame:
            f = self.frame
            while start < min(n, len(f)) and prompt[start] == f[start]:
                start += 1
            while tail < min(n - start, len(f) - start) and prompt[n - 1 - tail] == f[len(f) - 1 - tail]:
                tail += 1
        start = max(start, 1)
        return (start, n - tail) if n - tail > start else (min(1, n - 1), n)

    def __call__(self, h: torch.Tensor, prompt: list[int]) -> torch.Tensor:
        start, end = self.span(prompt)
        frame = torch.cat([h[1:start], h[end:len(prompt)]])
        center = frame.mean(dim=0) if len(frame) else self.neutral
        return h[start:end].mean(dim=0) - center


@dataclass(frozen=True)
class Example:
    id: int
    tenant: str
    time: float
    score: float
    prompt_ids: list[int]
    target_ids: list[int]
    cluster: int  # the id of its cluster's first example


def _ids(blob: bytes) -> list[int]:
    return np.frombuffer(blob, dtype=np.int32).tolist()


class PatternBank:
    """`duplicate_similarity`: an example whose embedding has at least this cosine similarity with
    one already in the tenant's bank joins that example's cluster."""

    def __init__(self, path: str | Path, duplicate_similarity: float = 0.95, max_indexes: int = 64) -> None:
        self.path = Path(path).expanduser()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.threshold = duplicate_similarity
        self._conn = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False, timeout=10)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.executescript(_SCHEMA)
        self._lock = threading.Lock()
        # tenant -> (faiss index, example ids), the `max_indexes` most recently used (the others are
        # rebuilt from SQLite when next searched): memory does not grow with every tenant that learned
        self._indexes: OrderedDict[str, tuple[object, list[int]]] = OrderedDict()
        self.max_indexes = max_indexes

    def close(self) -> None:
        self._conn.close()

    def _index(self, tenant: str) -> tuple[object, list[int]]:
        import faiss

        if tenant not in self._indexes:
            rows = self._conn.execute("SELECT id, embedding FROM examples WHERE tenant = ? ORDER BY id",
                                      (tenant,)).fetchall()
            index, ids = None, []
            for eid, emb in rows:
                vec = np.frombuffer(emb, dtype=np.float32)[None]
                if index is None:
                    index = faiss.IndexFlatIP(vec.shape[1])
                index.add(vec)
                ids.append(eid)
            self._indexes[tenant] = (index, ids)
        self._indexes.move_to_end(tenant)
        while len(self._indexes) > self.max_indexes:
            self._indexes.popitem(last=False)
        return self._indexes[tenant]

    def add(self, tenant: str, prompt_ids: list[int], target_ids: list[int], score: float,
            embedding: np.ndarray) -> Example:
        """Store an example; it joins the cluster of its nearest neighbour when that is a near-duplicate."""
        import faiss

        vec = np.ascontiguousarray(embedding, dtype=np.float32).reshape(1, -1)
        vec /= max(float(np.linalg.norm(vec)), 1e-12)
        with self._lock:
            index, ids = self._index(tenant)
            cluster = None
            if index is not None and index.ntotal:
                sim, pos = index.search(vec, 1)
                if sim[0, 0] >= self.threshold:
                    cluster = self._conn.execute("SELECT cluster FROM examples WHERE id = ?",
                                                 (ids[pos[0, 0]],)).fetchone()[0]
            cur = self._conn.execute(
                "INSERT INTO examples (tenant, time, score, prompt, target, embedding, cluster) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (tenant, time.time(), float(score), np.asarray(prompt_ids, dtype=np.int32).tobytes(),
                 np.asarray(target_ids, dtype=np.int32).tobytes(), vec.tobytes(), cluster))
            eid = int(cur.lastrowid)
            if cluster is None:
                cluster = eid
                self._conn.execute("UPDATE examples SET cluster = ? WHERE id = ?", (eid, eid))
            if index is None:
                index = faiss.IndexFlatIP(vec.shape[1])
                self._indexes[tenant] = (index, ids)
            index.add(vec)
            ids.append(eid)
        return Example(eid, tenant, time.time(), float(score), list(prompt_ids), list(target_ids), cluster)

    def nearest(self, tenant: str, embedding: np.ndarray, k: int = 5) -> list[tuple[float, Example]]:
        """The tenant's k examples most like `embedding` (cosine similarity, highest first)."""
        vec = np.ascontiguousarray(embedding, dtype=np.float32).reshape(1, -1)
        vec /= max(float(np.linalg.norm(vec)), 1e-12)
        with self._lock:
            index, ids = self._index(tenant)
            if index is None or not index.ntotal:
                return []
            sims, pos = index.search(vec, min(k, index.ntotal))
            found = [(float(s), ids[p]) for s, p in zip(sims[0], pos[0]) if p >= 0]
        return [(s, self.get(eid)) for s, eid in found]

    def get(self, eid: int) -> Example:
        row = self._conn.execute("SELECT id, tenant, time, score, prompt, target, cluster FROM examples WHERE id = ?",
                                 (eid,)).fetchone()
        return Example(row[0], row[1], row[2], row[3], _ids(row[4]), _ids(row[5]), row[6])

    def best_per_cluster(self, tenant: str) -> list[Example]:
        """One example a cluster: the highest score, then the newest (what the deep loop trains on)."""
        rows = self._conn.execute(
            "SELECT id FROM (SELECT id, cluster, ROW_NUMBER() OVER (PARTITION BY cluster ORDER BY score DESC, "
            "time DESC, id DESC) AS rank FROM examples WHERE tenant = ?) WHERE rank = 1 ORDER BY id", (tenant,)).fetchall()
        return [self.get(r[0]) for r in rows]

    def tenants(self) -> list[str]:
        return [r[0] for r in self._conn.execute("SELECT DISTINCT tenant FROM examples ORDER BY tenant")]

    def count(self, tenant: str) -> int:
        return int(self._conn.execute("SELECT COUNT(*) FROM examples WHERE tenant = ?", (tenant,)).fetchone()[0])
