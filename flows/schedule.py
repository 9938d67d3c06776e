"""The nightly schedule of ``params.yaml`` (``schedule.cron`` in ``schedule.timezone``) as Prefect's ``Cron``.

Both ``flows.serve`` and ``flows.deploy`` build it here, so a cron expression Prefect refuses is
reported as the params key, its value and the fix, not as a Prefect traceback (``grpo/config.py``
checks the time zone when params.yaml is read).
"""

from __future__ import annotations

from pathlib import Path

from prefect.schedules import Cron
from pydantic import ValidationError

from grpo.config import ConfigError, ScheduleConfig


def nightly_cron(schedule: ScheduleConfig, params: Path) -> Cron:
    """``Cron(schedule.cron, timezone=schedule.timezone)``; ConfigError naming the key when Prefect refuses
    the cron expression (the config has already checked the time zone)."""
    try:
        return Cron(schedule.cron, timezone=schedule.timezone)
    except (ValueError, ValidationError) as exc:
        raise ConfigError(
            f"{params}: schedule.cron {schedule.cron!r} is refused by Prefect ({exc}); give five "
            "fields, minute hour day month weekday, e.g. '0 2 * * *'"
        ) from None
