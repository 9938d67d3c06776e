"""The nightly schedule of ``params.yaml`` (``schedule.cron`` in ``schedule.timezone``) as Prefect's ``Cron``.

Both ``flows.serve`` and ``flows.deploy`` build it here, so a cron expression Prefect refuses is
reported as the params key, its value and the fix, not as a Prefect traceback (``grpo/config.py``
checks the time zone when params.yaml is read).

The deployment page shows a schedule by its slug when it has one, and Prefect's own wording of a cron
(``At 02:00 AM every day``) leaves the time zone out: the slug is the schedule in words with its time
zone, ``every day at 02:00 (UTC)``. Schedules are matched by slug when a deployment is updated, so a
changed schedule would be added beside the old one: ``drop_other_schedules`` removes the old one first.
"""

from __future__ import annotations

from pathlib import Path

from prefect.client.orchestration import get_client
from prefect.exceptions import ObjectNotFound
from prefect.schedules import Cron
from pydantic import ValidationError

from grpo.config import ConfigError, ScheduleConfig


def schedule_label(schedule: ScheduleConfig) -> str:
    """``every day at 02:00 (UTC)`` for a daily cron, else ``cron 0 2 * * 1-5 (Europe/Paris)``."""
    fields = schedule.cron.split()
    if len(fields) == 5 and fields[0].isdigit() and fields[1].isdigit() and fields[2:] == ["*"] * 3:
        return f"every day at {int(fields[1]):02d}:{int(fields[0]):02d} ({schedule.timezone})"
    return f"cron {schedule.cron} ({schedule.timezone})"


def nightly_cron(schedule: ScheduleConfig, params: Path) -> Cron:
    """``Cron(schedule.cron, timezone=schedule.timezone)``, its slug ``schedule_label``; ConfigError naming
    the key when Prefect refuses the cron expression (the config has already checked the time zone)."""
    try:
        return Cron(schedule.cron, timezone=schedule.timezone, slug=schedule_label(schedule))
    except (ValueError, ValidationError) as exc:
        raise ConfigError(
            f"{params}: schedule.cron {schedule.cron!r} is refused by Prefect ({exc}); give five "
            "fields, minute hour day month weekday, e.g. '0 2 * * *'"
        ) from None


def drop_other_schedules(deployment: str, keep: str) -> None:
    """Delete the schedules of ``deployment`` (``flow/name``) whose slug is not ``keep``, if it exists."""
    with get_client(sync_client=True) as client:
        try:
            found = client.read_deployment_by_name(deployment)
        except ObjectNotFound:
            return
        for schedule in found.schedules:
            if schedule.slug != keep:
                client.delete_deployment_schedule(found.id, schedule.id)
