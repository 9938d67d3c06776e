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
