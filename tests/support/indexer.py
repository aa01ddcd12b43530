"""A token-keyed KV-block indexer that follows llm-d's rules, for tests of kvtier's events.

The rules are those of llm-d's indexer (``llm-d/llm-d-kv-cache``: ``pkg/kvevents/pool.go`` for
events, ``pkg/kvcache/kvblock_scorer.go`` for scores):

- a message's topic ``kv@<pod>@<model>`` names the pod credited with its blocks and the model hashed
  into their keys (an event's ``lora_name`` replaces the model);
- a block's key is a hash of its parent's key, the model, its tokens and its extra keys, computed
  from ``token_ids`` at the indexer's own block size: keys never depend on the engine's hashes;
- the engine's hashes only map to keys: a ``BlockStored`` whose ``parent_block_hash`` maps to no key
  is dropped; one without tokens adds its pod and medium to the keys its hashes already map to, and
  is dropped when they map to none;
- ``BlockRemoved`` takes the pod's entry of that medium off the keys its hashes map to;
  ``AllBlocksCleared`` takes every entry of the pod off, whatever the medium;
- media are lower-cased and weighed by ``weights``; a medium not listed weighs 1.0, as the GPU;
- a prompt's score for a pod is the sum, over the longest run of leading blocks the pod holds, of
  the highest weight among the media holding each block there.

The hash function is this module's (sha256), not llm-d's: only the rules matter to the tests.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Sequence
from typing import Any

import msgspec

DEFAULT_WEIGHTS = {"gpu": 1.0, "cpu": 0.8}  # llm-d's defaults
Entry = tuple[str, str]  # (pod, medium)


def engine_key(block_hash: int | bytes) -> int:
    """An engine block hash as llm-d keeps it: the int itself, or a hash's last 8 bytes (big-endian)."""
    if isinstance(block_hash, bytes):
        return int.from_bytes(block_hash[-8:].rjust(8, b"\0"), "big")
    return int(block_hash) & ((1 << 64) - 1)


def parse_topic(topic: bytes) -> tuple[str, str]:
    """(pod, model) of a ``kv@<pod>@<model>`` topic; (topic, "") for any other."""
    text = topic.decode()
    parts = text.split("@")
    return (parts[1], parts[2]) if len(parts) == 3 else (text, "")


class Indexer:
    """Blocks keyed by their tokens, with the pods and media that hold them (see the module)."""

    def __init__(self, block_size: int, weights: dict[str, float] | None = None) -> None:
        self.block_size = block_size
        self.weights = dict(DEFAULT_WEIGHTS if weights is None else weights)
        self._key_of: dict[int, bytes] = {}  # engine hash -> block key
        self._held: dict[bytes, set[Entry]] = {}
        self.dropped: Counter[str] = Counter()  # events dropped, by reason

    # ------------------------------------------------------------------------------------ events
    def apply(self, topic: bytes, batch: Any) -> None:
        """Apply one decoded ``KVEventBatch`` (vLLM's classes) published under topic."""
        pod, model = parse_topic(topic)
        for event in batch.events:
            kind = type(event).__name__
            if kind == "BlockStored":
                self._stored(pod, model, event)
            elif kind == "BlockRemoved":
                medium = (event.medium or "gpu").lower()
                for h in event.block_hashes:
                    key = self._key_of.get(engine_key(h))
                    if key is not None:
                        self._held.get(key, set()).discard((pod, medium))
            elif kind == "AllBlocksCleared":
                for entries in self._held.values():
                    entries.difference_update({e for e in entries if e[0] == pod})

    def apply_frames(self, topic: bytes, payload: bytes) -> None:
        """Apply one message as it arrives on a SUB socket (its topic and msgpack payload)."""
        from vllm.distributed import kv_events

        self.apply(topic, msgspec.msgpack.decode(payload, type=kv_events.KVEventBatch))

    def _stored(self, pod: str, model: str, event: Any) -> None:
        entry = (pod, (event.medium or "gpu").lower())
        engine = [engine_key(h) for h in event.block_hashes]
        parent: bytes | None = None
        if event.parent_block_hash is not None and engine_key(event.parent_block_hash) != 0:
            parent = self._key_of.get(engine_key(event.parent_block_hash))
            if parent is None:
                self.dropped["parent not indexed"] += 1
                return
        model = event.lora_name or model
        keys = self.keys(event.token_ids, model, parent, event.extra_keys, event.block_size)
        if not keys:
            known = [self._key_of[h] for h in engine if h in self._key_of]
            if not known:
                self.dropped["no tokens, hashes not indexed"] += 1
            for key in known:
                self._held.setdefault(key, set()).add(entry)
            return
        for i, h in enumerate(engine):  # each engine block maps to the key of the block it ends in
            end = (i + 1) * len(event.token_ids) // len(engine)
            self._key_of[h] = keys[max(0, end // self.block_size - 1)]
        for key in keys:
            self._held.setdefault(key, set()).add(entry)

    # ------------------------------------------------------------------------------------ keys and scores
    def keys(
        self,
        tokens: Sequence[int],
        model: str,
        parent: bytes | None = None,
        extra_keys: Sequence[Any] | None = None,
        engine_block_size: int | None = None,
    ) -> list[bytes]:
        """The chained keys of tokens' full blocks (a partial last block has none)."""
        size, out = self.block_size, []
        prev = parent or b""
        for start in range(0, len(tokens) - size + 1, size):
            extra = None
            if extra_keys is not None and engine_block_size:
                extra = extra_keys[start // engine_block_size]
            digest = hashlib.sha256(
                prev + model.encode() + repr((list(tokens[start : start + size]), extra)).encode()
            )
            prev = digest.digest()
            out.append(prev)
        return out

    def holders(self, tokens: Sequence[int], model: str) -> list[set[Entry]]:
        """Per leading block of a prompt, the (pod, medium) entries that hold it."""
        return [set(self._held.get(key, ())) for key in self.keys(tokens, model)]

    def score(self, tokens: Sequence[int], model: str) -> dict[str, float]:
        """llm-d's longest-prefix score of each pod for a prompt."""
        scores: dict[str, float] = {}
        active: set[str] | None = None
        for entries in self.holders(tokens, model):
            best: dict[str, float] = {}
            for pod, medium in entries:
                best[pod] = max(best.get(pod, 0.0), self.weights.get(medium, 1.0))
            active = set(best) if active is None else active & set(best)
            if not active:
                break
            for pod in active:
                scores[pod] = scores.get(pod, 0.0) + best[pod]
        return scores

    def leading_blocks(
        self, tokens: Sequence[int], model: str, pod: str, media: set[str] | None = None
    ) -> int:
        """How many leading blocks of a prompt pod holds (in one of media, when given)."""
        count = 0
        for entries in self.holders(tokens, model):
            if not any(p == pod and (media is None or m in media) for p, m in entries):
                break
            count += 1
        return count

    def best_pod(self, tokens: Sequence[int], model: str) -> str | None:
        """The pod a router following llm-d's scorer sends the prompt to (None: no pod holds any)."""
        scores = self.score(tokens, model)
        return max(sorted(scores), key=lambda p: scores[p]) if scores else None
