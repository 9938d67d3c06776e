"""Multi-process training on 2 CPU processes (gloo): FSDP2 and DDP steps equal one unsharded step;
the accelerate config files under configs/accelerate/ load and say what the README says."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from accelerate.commands.config.config_args import load_config_from_file

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs" / "accelerate"


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_two_process_step_equals_one_unsharded_step(strategy, tmp_path):
    out = tmp_path / "result.json"
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    done = subprocess.run(
        [torchrun, "--standalone", "--nproc_per_node", "2", "-m", "tests.sharded_step", strategy, str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
        env=os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["world"] == 2 and result["names_match"]
    assert result["sharded"] == (strategy == "fsdp")  # FSDP holds DTensor shards, DDP full replicas
    assert result["max_update"] > 1e-3  # the step moved the weights
    assert result["max_abs_diff"] < 1e-5  # ...exactly as one process on the whole batch


@pytest.mark.parametrize("name, distributed_type", [("ddp.yaml", "MULTI_GPU"), ("fsdp.yaml", "FSDP")])
def test_accelerate_config_files_load(name, distributed_type):
    config = load_config_from_file(str(CONFIGS / name))
    assert config.distributed_type == distributed_type
    assert config.mixed_precision == "bf16" and config.num_machines == 1
    if distributed_type == "FSDP":
        assert config.fsdp_config["fsdp_version"] == 2
        assert config.fsdp_config["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"


# --------------------------------------------------------------------------- the trainer's switch


def test_the_trainer_shards_when_accelerate_launches_fsdp(monkeypatch):
    """``accelerate launch --config_file configs/accelerate/fsdp.yaml`` sets ACCELERATE_USE_FSDP in
    each process; that, or accelerate's FSDP distributed type, is what makes the trainer shard."""
    from accelerate import Accelerator

    from grpo.train.sharding import fsdp_requested

    accelerator = Accelerator(cpu=True)
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    assert not fsdp_requested(accelerator)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    assert fsdp_requested(accelerator)


def test_fsdp_refuses_the_vllm_engine_with_the_fix():
    """vLLM reads whole weights from the trainer's model: refused before any weight is loaded."""
    from grpo.config import ConfigError, config_from_dict
    from grpo.train.sharding import check_supported

    cfg = config_from_dict({})
    check_supported(cfg)  # the default hf engine shards
    rollout = cfg.grpo.rollout.model_copy(update={"engine": "vllm"})  # vLLM itself is not installed here
    cfg = cfg.model_copy(update={"grpo": cfg.grpo.model_copy(update={"rollout": rollout})})
    with pytest.raises(ConfigError, match=r"grpo\.rollout\.engine is 'vllm'.*Set grpo\.rollout\.engine: hf"):
        check_supported(cfg)
