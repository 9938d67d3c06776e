"""Stage ``validate``: the Great Expectations gate over ``<data_dir>/{train,eval}.jsonl``.

Reads both files (bad bytes and bad JSON lines become ``read.*`` rules with their line numbers),
builds one dataframe with derived check columns (``grpo/data/rules.py``), runs the suite of
``grpo/data/suite.py`` once in an ephemeral GX context, and writes ``<reports_dir>/validation.json``,
``validation.md`` and GX Data Docs under ``<reports_dir>/data_docs/``. Any failed rule raises
``DataValidationError`` naming the rule, the file and example rows. Only the reports are written:
the data and every other output are left as they are.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import great_expectations as gx
import pandas as pd
from great_expectations.data_context.types.base import ProgressBarsConfig

from grpo import paths
from grpo.config import Config
from grpo.data.errors import DataValidationError
from grpo.data.jsonl import SOURCES_FILE, RawRow, ReadProblem, read_rows
from grpo.data.report import (
    ValidationReport,
    failure_message,
    gx_results,
    read_results,
    to_json,
    to_markdown,
)
from grpo.data.rules import build_frame
from grpo.data.schema import SPLITS
from grpo.data.suite import build_expectations
from grpo.files import write_atomically
from grpo.locks import writes

DOCS_SITE = "grpo_data_docs"


def _checkpoint(frame: pd.DataFrame, cfg: Config, docs_dir: Path | None) -> gx.Checkpoint:
    context = gx.get_context(mode="ephemeral")
    context.variables.progress_bars = ProgressBarsConfig(globally=False)
    asset = context.data_sources.add_pandas("processed").add_dataframe_asset("records")
    batch = asset.add_batch_definition_whole_dataframe("train_and_eval")
    # One suite built whole: adding expectations one by one re-serialises the suite each time.
    suite = context.suites.add(
        gx.ExpectationSuite(name="grpo_data", expectations=build_expectations(frame, cfg))
    )
    definition = context.validation_definitions.add(
        gx.ValidationDefinition(name="processed", data=batch, suite=suite)
    )
    actions = []
    if docs_dir is not None:
        # The ephemeral context's default site lives in a throwaway temp dir: build our own.
        context.add_data_docs_site(
            DOCS_SITE,
            {
                "class_name": "SiteBuilder",
                "store_backend": {
                    "class_name": "TupleFilesystemStoreBackend",
                    "base_directory": str(docs_dir.resolve()),
                },
                "site_index_builder": {"class_name": "DefaultSiteIndexBuilder"},
            },
        )
        actions.append(gx.checkpoint.UpdateDataDocsAction(name="data_docs", site_names=[DOCS_SITE]))
    result_format = {"result_format": "SUMMARY", "partial_unexpected_count": cfg.data.checks.max_examples}
    return context.checkpoints.add(
        gx.Checkpoint(
            name="grpo_validate",
            validation_definitions=[definition],
            actions=actions,
            result_format=result_format,
        )
    )


def run_suite(frame: pd.DataFrame, cfg: Config, docs_dir: Path | None = None) -> list[Any]:
    """GX results of the whole suite on ``frame`` (one context, one suite, one validation)."""
    result = _checkpoint(frame, cfg, docs_dir).run(batch_parameters={"dataframe": frame})
    (validation,) = result.run_results.values()
    return list(validation.results)


def validate_files(paths: Mapping[str, Path], cfg: Config, docs_dir: Path | None = None) -> ValidationReport:
    """Validate the processed files (split -> path); writes nothing unless ``docs_dir`` is given."""
    rows: dict[str, Sequence[RawRow]] = {}
    problems: list[ReadProblem] = []
    for split, path in paths.items():
        rows[split], found = read_rows(Path(path))
        problems.extend(found)
    frame = build_frame(rows)
    checks = cfg.data.checks
    rules = read_results(problems, checks.max_examples) + gx_results(
        run_suite(frame, cfg, docs_dir), frame, checks.max_examples
    )
    return ValidationReport([str(path) for path in paths.values()], len(frame), rules)


def _replace_dir(staged: Path, final: Path) -> None:
    """Swap a freshly built folder into place; the old one is removed only after the swap."""
    old = final.with_name(f".{final.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    staged.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def _sources(data_dir: Path) -> dict[str, Any] | None:
    """``sources.json`` written by ``grpo prepare`` (absent for data made by older code)."""
    path = data_dir / SOURCES_FILE
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


@writes(lambda cfg: cfg.paths.reports_dir)
def run(cfg: Config) -> int:
    """Validate ``paths.data_dir``; write the reports; raise DataValidationError on any failed rule."""
    reports = paths.reports_dir(cfg)
    reports.mkdir(parents=True, exist_ok=True)
    files = {split: paths.data_file(cfg, split) for split in SPLITS}
    staged = Path(tempfile.mkdtemp(prefix=".data_docs.", dir=reports)) if cfg.data.checks.data_docs else None
    try:
        report = validate_files(files, cfg, docs_dir=staged)
        write_atomically(
            {
                paths.report_file(cfg, "validation.json"): to_json(report),
                paths.report_file(cfg, "validation.md"): to_markdown(
                    report, _sources(Path(cfg.paths.data_dir))
                ),
            }
        )
        if staged is not None:
            _replace_dir(staged, paths.report_file(cfg, "data_docs"))
    finally:
        if staged is not None:
            shutil.rmtree(staged, ignore_errors=True)
    if not report.success:
        raise DataValidationError(failure_message(report, str(reports / "validation.md")))
    print(f"validate: {len(report.rules)} rules passed on {report.n_rows} records; reports in {reports}")
    return 0
