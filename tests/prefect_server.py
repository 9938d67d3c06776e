"""A real ``prefect server start`` on a free 127.0.0.1 port, for the tests that use Prefect's CLI, workers or UI.

One server per test module (a module-scoped fixture wraps ``running_server``); every process started
here is stopped (its whole process group) on the way out, and every wait is bounded.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.processes import stop

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(check, timeout: float, what: str, logs: list[Path], every: float = 1.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(every)
    tails = "\n".join(f"--- {log}\n{log.read_text(errors='replace')[-3000:]}" for log in logs if log.is_file())
    raise AssertionError(f"{what} not ready after {timeout:.0f}s\n{tails}")


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


@dataclass
class Server:
    """A running server: its API URL, the environment that points at it, the folder for logs."""

    api: str
    env: dict[str, str]
    home: Path
    procs: list[subprocess.Popen]

    def start(self, args: list[str], cwd: Path, log_name: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start a process in its own group (stopped with the server), output in ``home/<log_name>``."""
        with (self.home / log_name).open("w") as log:
            proc = subprocess.Popen(args, cwd=cwd, env=env or self.env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        self.procs.append(proc)
        return proc

    def env_for(self, project: Path) -> dict[str, str]:
        """The stage environment of ``project`` (its code first, offline) pointed at this server."""
        from tasks.dvc_stage import stage_env

        return {**stage_env(project), **{k: v for k, v in self.env.items() if k.startswith("PREFECT_")}}

    def logs(self) -> list[Path]:
        return sorted(self.home.glob("*.log"))


@contextlib.contextmanager
def running_server(home: Path, base_env: dict[str, str]) -> Iterator[Server]:
    """``prefect server start`` with PREFECT_HOME under ``home``; the UI is told the API's port."""
    home.mkdir(parents=True, exist_ok=True)
    api = f"http://127.0.0.1:{free_port()}/api"
    env = {**base_env, "PREFECT_HOME": str(home / "prefect_home"), "PREFECT_API_URL": api,
           "PREFECT_UI_API_URL": api, "PREFECT_LOGGING_LEVEL": "INFO"}
    env.pop("PREFECT_PROFILES_PATH", None)
    server = Server(api=api, env=env, home=home, procs=[])
    try:
        server.start([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1",
                      "--port", api.split(":")[-1].split("/")[0]], home, "server.log")
        wait_until(lambda: healthy(api), 180, "prefect server", server.logs())
        yield server
    finally:
        for proc in reversed(server.procs):
            stop(proc)
