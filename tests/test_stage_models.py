"""grpo/model/stage_models.py: the base model is refused when stale, by every stage that reads it (I12)."""

from __future__ import annotations

import shutil

import pytest

from grpo import paths
from grpo.config import config_from_dict
from grpo.data import prepare
from grpo.model.stage_models import check_sft, load_base
from grpo.provenance.lineage import StaleArtifactError, make_lineage, write_lineage
from grpo.train import pretrain, sft

TINY = {"vocab_size": 400, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512}


def _cfg(tmp_path, hidden_size: int):
    return config_from_dict({
        "paths": {name: str(tmp_path / name) for name in ("data_dir", "models_dir", "metrics_dir")},
        "data": {"n_train": 16, "n_eval": 4}, "model": {"tiny": TINY | {"hidden_size": hidden_size}},
        "pretrain": {"records": 0}, "sft": {"epochs": 1},
    })


def test_a_stale_base_is_refused_by_sft_and_under_a_current_looking_sft(tmp_path):
    """A base built under other params is refused by ``load_base`` (so ``grpo sft`` trains nothing on it),
    and ``check_sft`` refuses an SFT model whose own lineage matches the params but whose base is stale:
    SFT's lineage holds the base's content, not whether that base is current."""
    built, changed = _cfg(tmp_path, 32), _cfg(tmp_path, 64)
    assert prepare.run(built) == 0 and pretrain.run(built) == 0
    load_base(built)
    with pytest.raises(StaleArtifactError, match=r"model\.tiny.*hidden_size"):
        load_base(changed)
    with pytest.raises(StaleArtifactError, match=r"model\.tiny"):
        sft.run(changed)
    assert not paths.model_dir(changed, "sft").exists()
    # An SFT folder recorded as built under the changed params from this (stale) base.
    shutil.copytree(paths.model_dir(built, "base"), paths.model_dir(changed, "sft"))
    write_lineage(paths.model_dir(changed, "sft"), make_lineage("sft", changed, paths.stage_inputs(changed, "sft")))
    with pytest.raises(StaleArtifactError, match=r"model\.tiny"):
        check_sft(changed)
    write_lineage(paths.model_dir(built, "sft"), make_lineage("sft", built, paths.stage_inputs(built, "sft")))
    check_sft(built)
