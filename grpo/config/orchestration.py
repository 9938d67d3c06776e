"""``schedule``: the nightly Prefect deployment of the full-retrain flow (read by ``flows/`` only)."""

from __future__ import annotations

import zoneinfo

from pydantic import field_validator

from grpo.config.base import Section


class ScheduleConfig(Section):
    cron: str = "0 2 * * *"
    """Cron expression of the nightly ``full-retrain`` run (read in ``timezone``)."""
    timezone: str = "UTC"
    """IANA time zone the cron expression is read in, e.g. ``Europe/Paris``."""

    @field_validator("timezone")
    @classmethod
    def _known_time_zone(cls, value: str) -> str:
        try:
            zoneinfo.ZoneInfo(value)
        except (zoneinfo.ZoneInfoNotFoundError, ValueError):
            raise ValueError("is not an IANA time zone: give one such as UTC or Europe/Paris") from None
        return value

    deployment: str = "full-retrain"
    """Deployment name: ``prefect deployment run full-retrain/<deployment>`` triggers a run."""
    force: bool = False
    """Scheduled runs pass ``force``: rerun every stage even when DVC finds nothing stale."""
