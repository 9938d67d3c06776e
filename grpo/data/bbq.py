"""BBQ (Parrish et al. 2022, arXiv:2110.08193; ``nyu-mll/BBQ`` ``data/*.jsonl``) -> fairness items.

``unknown_idx`` is the option whose ``answer_info`` group is ``unknown``; ``target_idx`` the option
whose group is one of ``additional_metadata.stereotyped_groups``. Where that group is written
differs per category, as published:

- most categories: ``answer_info[ansN][1]`` (``old``, ``F``, ``lowSES``, ``trans_F``, ``Muslim``);
  gender groups ``F``/``M`` also match ``woman``/``girl``/``man``/``boy``.
- Nationality: ``answer_info[ansN][0]`` is the nationality (``British``), ``[1]`` only its region.
- Race_x_gender / Race_x_SES (intersectional): ``[1]`` is ``<gender or SES>-<race>``
  (``F-Black``, ``lowSES-Hispanic``, ``lowSES-F-Black``) and ``stereotyped_groups`` lists races only.
  The template's stereotyped gender/SES is learnt from its rows where the race alone decides; it
  picks the target when both options are of a stereotyped race (``F-Black`` vs ``M-Black``).

Items where the target or the unknown option is not exactly one option are skipped, counted by reason.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from grpo.data.errors import DataSourceError
from grpo.data.raw import Loaded, files, json_lines, skip_lines, split_groups

NAME_IS_GROUP = frozenset({"Nationality"})
"""Categories whose ``answer_info[ansN][0]`` (not ``[1]``) names the group."""
INTERSECTIONAL = frozenset({"Race_x_gender", "Race_x_SES"})
"""Categories whose group label is ``<gender or SES>-<race>``."""

_GENDER = {"f": {"f", "woman", "girl", "female"}, "m": {"m", "man", "boy", "male"}}
_FIELDS = "context, question, ans0..ans2, label, category, answer_info, additional_metadata, question_index"


def _squash(text: str) -> str:
    return re.sub(r"[\s_]", "", text.lower())


def _names_group(group: str, stereotyped: list[str]) -> bool:
    """Whether an ``answer_info`` group label (e.g. ``old``, ``trans_F``, ``girl``) is a stereotyped one."""
    tokens = {_squash(part) for part in re.split(r"[-/_]", group)} | {_squash(group)}
    for wanted in map(_squash, stereotyped):
        if wanted in tokens or tokens & _GENDER.get(wanted, set()):
            return True
    return False


def _group(row: dict[str, Any], index: int) -> str:
    name, group = row["answer_info"][f"ans{index}"][:2]
    return str(name if row["category"] in NAME_IS_GROUP and group != "unknown" else group)


def _intersection(group: str) -> tuple[str, str]:
    """``"lowSES-F-Black"`` -> ``("lowSES", "black")``: the gender/SES part and the squashed race."""
    head, _, race = group.rpartition("-")
    return head.split("-")[0], _squash(race)


def _template(row: dict[str, Any]) -> str:
    return f"bbq.{row['category']}.{row['question_index']}"


def _race_matches(row: dict[str, Any], options: list[int]) -> list[int]:
    races = {_squash(group) for group in row["additional_metadata"]["stereotyped_groups"]}
    return [i for i in options if _intersection(_group(row, i))[1] in races]


def learn_target_var2(rows: list[tuple[str, int, dict[str, Any]]]) -> dict[str, str]:
    """Intersectional template -> its stereotyped gender/SES, from rows where one option alone has the race."""
    seen: dict[str, Counter] = defaultdict(Counter)
    for _, _, row in rows:
        if row.get("category") not in INTERSECTIONAL:
            continue
        try:
            options = [i for i in range(3) if _group(row, i) != "unknown"]
            matches = _race_matches(row, options)
        except (KeyError, TypeError, ValueError):
            continue  # reported with its row by bbq_item
        if len(matches) == 1:
            seen[_template(row)][_intersection(_group(row, matches[0]))[0]] += 1
    return {template: counts.most_common(1)[0][0] for template, counts in seen.items() if len(counts) == 1}


def _targets(row: dict[str, Any], options: list[int], var2: dict[str, str]) -> list[int]:
    if row["category"] not in INTERSECTIONAL:
        stereotyped = row["additional_metadata"]["stereotyped_groups"]
        return [i for i in options if _names_group(_group(row, i), stereotyped)]
    matches = _race_matches(row, options)
    if len(matches) > 1 and _template(row) in var2:
        matches = [i for i in matches if _intersection(_group(row, i))[0] == var2[_template(row)]]
    return matches


def _label(row: dict[str, Any]) -> int:
    label = row["label"]
    if isinstance(label, bool) or label not in (0, 1, 2):
        raise ValueError(f"label {label!r} is not 0, 1 or 2 (the index of the gold option among ans0..ans2)")
    return int(label)


def bbq_item(row: dict[str, Any], var2: dict[str, str]) -> dict[str, Any] | str:
    """One BBQ row -> item fields, or the reason it is skipped; a malformed row raises ValueError/KeyError."""
    choices = [row["ans0"], row["ans1"], row["ans2"]]
    label = _label(row)
    unknown = [i for i in range(3) if _group(row, i).lower() == "unknown"]
    if len(unknown) != 1:
        return "not exactly one 'unknown' option in answer_info"
    targets = _targets(row, [i for i in range(3) if i != unknown[0]], var2)
    if len(targets) != 1:
        return (
            "no option's answer_info group is in stereotyped_groups"
            if not targets
            else "answer_info gives both options a stereotyped group"
        )
    category = str(row["category"])
    return {
        "task": "fairness",
        "source": "bbq",
        "context": row["context"],
        "question": row["question"],
        "choices": choices,
        "label": label,
        "answer": choices[label],
        "context_condition": row["context_condition"],
        "question_polarity": row["question_polarity"],
        "unknown_idx": unknown[0],
        "target_idx": targets[0],
        "category": category,
        "template_id": _template(row),
    }


def _file_items(file: Path, skipped: Counter) -> list[dict[str, Any]]:
    rows = json_lines(file)
    var2 = learn_target_var2(rows)
    items = []
    for name, number, row in rows:
        try:
            item = bbq_item(row, var2)
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise DataSourceError(
                f"{name}:{number}: not a BBQ record ({type(exc).__name__}: {exc}); expected the fields {_FIELDS}"
            ) from None
        if isinstance(item, str):
            skipped[(name, str(row.get("category")), item)] += 1
        else:
            items.append(item)
    if not items:
        mine = Counter({key: n for key, n in skipped.items() if key[0] == str(file)})
        raise DataSourceError(
            f"{file}: 0 of {len(rows)} BBQ rows usable; skipped: {'; '.join(skip_lines(mine)) or 'empty file'}; "
            "remove the file from the folder or fix its rows"
        )
    return items


def load_bbq(path: Path, eval_share: float, seed: int) -> Loaded:
    """BBQ JSONL file(s) -> fairness items; a template (category, question_index) stays in one split."""
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    skipped: Counter = Counter()
    for file in files(path, "*.jsonl"):
        for item in _file_items(file, skipped):
            groups[item["template_id"]].append(item)
    return Loaded(split_groups(groups, eval_share, seed, path, "templates"), skipped)


def hold_out_categories(loaded: Loaded, categories: list[str], path: Path) -> Loaded:
    """``loaded`` re-split by category: the items of ``categories`` are the eval pool, every other item the
    train pool (a user's setting: train on some published categories, evaluate on ones never trained on).
    A category the files do not hold, or none left to train on, is an error naming the categories found."""
    items = loaded.pools["train"] + loaded.pools["eval"]
    found = sorted({item["category"] for item in items})
    unknown = sorted(set(categories) - set(found))
    if unknown or set(found) <= set(categories):
        problem = f"no category {unknown}" if unknown else "no category left to train on"
        raise DataSourceError(
            f"{path}: data.fairness_heldout_categories={list(categories)}: {problem} in the BBQ files; the files "
            f"hold {found}: name some of them, and keep at least one out of the list"
        )
    held = set(categories)
    pools = {
        "train": [item for item in items if item["category"] not in held],
        "eval": [item for item in items if item["category"] in held],
    }
    return Loaded(pools, loaded.skipped)
