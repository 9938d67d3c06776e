"""GRPO's validation split: records set aside from its training prompts, in equal shares of each kind.

Checkpoint selection (``grpo/train/selection.py``) scores the policy on them every few steps; GRPO never
samples them as prompts, and they never are eval items (they come from the train split).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from grpo.data.kinds import record_kind


def validation_split(records: Sequence[dict], n: int, seed: int) -> tuple[list[dict], list[dict]]:
    """``(train, validation)``: ``n`` of ``records`` set aside in equal shares of each kind of item present
    (``grpo/data/kinds.py``; a kind with too few gives all it has), the rest kept in file order. Within a
    kind the records with the lowest seeded hash of their id are taken, so the split depends on the seed
    and the records, never on their order."""
    if not records or n <= 0:
        return list(records), []
    by_kind: dict[str, list[dict]] = {}
    for record in records:
        by_kind.setdefault(record_kind(record), []).append(record)
    kinds = sorted(by_kind)
    quotas = {kind: n // len(kinds) + (index < n % len(kinds)) for index, kind in enumerate(kinds)}

    def rank(record: dict) -> str:
        return hashlib.sha256(f"validation\x1f{seed}\x1f{record['id']}".encode()).hexdigest()

    chosen = {r["id"] for kind in kinds for r in sorted(by_kind[kind], key=rank)[: quotas[kind]]}
    return [r for r in records if r["id"] not in chosen], [r for r in records if r["id"] in chosen]
