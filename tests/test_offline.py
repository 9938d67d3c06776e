"""grpo/offline.py: nothing goes online unless model.allow_download; a missing model fails at once, one way."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from grpo.config import ModelConfig
from grpo.model.loading import ModelLoadError, load_model, load_tokenizer
from grpo.offline import OFFLINE_ENV, offline_by_default

ROOT = Path(__file__).parents[1]
PROBE = (
    "import os, sys\nfrom grpo import cli\n"
    "def probe(cfg, **options):\n"
    "    import huggingface_hub.constants as c\n"
    "    print(os.environ.get('HF_HUB_OFFLINE'), os.environ.get('TRANSFORMERS_OFFLINE'), c.HF_HUB_OFFLINE)\n"
    "    return 0\n"
    "cli.resolve = lambda entry: probe\n"
    "raise SystemExit(cli.main(sys.argv[1:]))\n"
)


def _plain_shell_env() -> dict[str, str]:
    """The environment of a shell that exported none of the Makefile's offline variables."""
    env = {key: value for key, value in os.environ.items() if key not in OFFLINE_ENV}
    return {**env, "PYTHONPATH": str(ROOT)}


def _grpo(tmp_path: Path, *args: str, code: str | None = None) -> subprocess.CompletedProcess:
    params = tmp_path / "params.yaml"
    params.write_text("experiment: offline\n")
    command = ["-c", code] if code else ["-m", "grpo.cli"]
    return subprocess.run([sys.executable, *command, *args, "--params", str(params)], capture_output=True,
                          text=True, cwd=tmp_path, env=_plain_shell_env(), timeout=120)


def test_grpo_commands_run_offline_from_a_plain_shell(tmp_path):
    result = _grpo(tmp_path, "base", code=PROBE)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1", "1", "True"]


def test_offline_by_default_covers_hub_transformers_and_datasets_and_keeps_a_users_value(monkeypatch):
    """The three libraries' offline switches, named here rather than read from ``OFFLINE_ENV``, are set
    where unset; a value the user exported stays (a user who exported ``HF_HUB_OFFLINE=0`` meant it)."""
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "0")
    offline_by_default()
    assert os.environ["HF_HUB_OFFLINE"] == "1" and os.environ["HF_DATASETS_OFFLINE"] == "1"
    assert os.environ["TRANSFORMERS_OFFLINE"] == "0"


def test_allow_download_lifts_the_default(tmp_path):
    result = _grpo(tmp_path, "base", "--set", "model.allow_download=true", code=PROBE)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["0", "0", "False"]


@pytest.mark.parametrize("name", ["models/nonexistent", "ABSOLUTE"])
def test_a_missing_model_folder_fails_at_once_with_one_message_and_code(tmp_path, name):
    name = str(tmp_path / "models" / "nonexistent") if name == "ABSOLUTE" else name
    start = time.monotonic()
    result = _grpo(tmp_path, "base", "--set", f"model.name_or_path={name}")
    assert time.monotonic() - start < 30  # no hub retries
    assert result.returncode == 2
    assert f"model.name_or_path model folder {name!r} does not exist (looked at {tmp_path / 'models' / 'nonexistent'})" \
        in result.stderr
    assert "nothing is downloaded: model.allow_download is false" in result.stderr


@pytest.mark.parametrize("loader", [load_model, load_tokenizer])
def test_loading_an_uncached_hub_id_fails_without_going_online(loader):
    cfg = ModelConfig()  # allow_download: false
    start = time.monotonic()
    with pytest.raises(ModelLoadError, match=r"'grpo-tests/not-cached-anywhere' does not exist .* not a hub id in the "):
        loader("grpo-tests/not-cached-anywhere", cfg)
    assert time.monotonic() - start < 5
