"""grpo/config/: one typed tree; bad values fail with the key, the value and the fix."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from grpo.cli import main
from grpo.config import Config, ConfigError, config_from_dict, config_to_dict, load_config
from grpo.sources import NAMED_SOURCES, SourceError, named_source_file

ROOT = Path(__file__).resolve().parents[1]


def write_params(tmp_path: Path, tree: dict) -> Path:
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def test_project_params_load():
    cfg = load_config(ROOT / "params.yaml")
    assert isinstance(cfg, Config)
    assert cfg.grpo.group_size >= 2


def test_every_field_is_documented():
    """STYLE.md 6: every field of the tree has a one-line doc."""
    undocumented = []

    def walk(model_cls, prefix):
        for name, field in model_cls.model_fields.items():
            if not field.description:
                undocumented.append(prefix + name)
            annotation = field.annotation
            if isinstance(annotation, type) and hasattr(annotation, "model_fields"):
                walk(annotation, prefix + name + ".")

    walk(Config, "")
    assert undocumented == []


@pytest.mark.parametrize(
    ("tree", "must_name"),
    [
        # table: bad config -> words the error must contain (key, value, fix)
        ({"grpo": {"group_size": 1}}, ["grpo.group_size", "got 1", "at least two completions"]),
        ({"checkpoint": {"every": 0}}, ["checkpoint.every", "got 0", "greater than or equal to 1"]),
        ({"grpo": {"sampling": {"temperature": -0.5}}}, ["grpo.sampling.temperature", "-0.5", "> 0"]),
        ({"data": {"hallucination_source": "squad2"}},
         ["data.hallucination_path is needed", "'squad2'", "--set data.hallucination_path="]),
        ({"schedule": {"timezone": "Mars/Base"}}, ["schedule.timezone", "Mars/Base", "IANA time zone"]),
        ({"eval": {"samples_per_prompt": 1}}, ["eval.samples_per_prompt", "is 1", "use 0 to decode greedily only"]),
        ({"grpo": {"lossx": {}}}, ["unknown key grpo.lossx", "remove it"]),
        ({"grpo": {"loss": {"loss_type": "bogus"}}}, ["grpo.loss.loss_type", "bogus"]),
        ({"model": {"name_or_path": "/nonexistent/model"}}, ["model.name_or_path", "/nonexistent/model", "does not exist"]),
        ({"grpo": {"loss": {"entropy_coef": float("nan")}}}, ["grpo.loss.entropy_coef", "nan", "finite number"]),
        ({"rewards": {"weights": {"fairness": float("inf")}}}, ["rewards.weights.fairness", "inf", "finite number"]),
        ({"grpo": {"rollout": {"tis_cap": 0.5}}}, ["grpo.rollout.tis_cap", "0.5", "greater than or equal to 1"]),
        ({"data": {"fairness_path": "/raw/bbq"}}, ["data.fairness_path is set but data.fairness_source is 'synthetic'"]),
        ({"model": {"lora": {"dropout": 1.0}}}, ["model.lora.dropout", "1.0", "less than 1"]),
        ({"data": {"fairness_source": "bbq", "fairness_path": ""}},
         ["data.fairness_path is needed when data.fairness_source is 'bbq'"]),  # "" is no path, not the cwd
        ({"data": {"fairness_source": "bbq"}}, ["data.fairness_path is needed when data.fairness_source is 'bbq'"]),
        ({"data": {"fairness_fraction": 1.5}}, ["data.fairness_fraction", "1.5", "less than or equal to 1"]),
        ({"model": {"tiny": {"num_attention_heads": 4, "num_key_value_heads": 3}}},
         ["model.tiny", "num_attention_heads (4) must be a multiple of num_key_value_heads (3)"]),
        ({"model": {"architecture": "qwen2.5-0.5b", "tokenizers_dir": None}},
         ["model", "'qwen2.5-0.5b'", "model.tokenizers_dir", "set it to a folder"]),
        ({"eval": {"diagnose": {"zero_std_fail": 95}}}, ["eval.diagnose.zero_std_fail", "95", "less than or equal to 1"]),
        ({"eval": {"bootstrap": 10}}, ["eval.bootstrap", "10", "greater than or equal to 100"]),
        ({"monitor": {"entropy_floor": {"threshold": 0.1, "window": 0}}},
         ["monitor.entropy_floor.window", "got 0", "greater than or equal to 1"]),
        ({"seed": "x", "grpo": {"group_size": 1}}, ["seed", "'x'", "grpo.group_size", "got 1"]),  # every error
    ],
)
def test_bad_config_names_key_value_and_fix(tmp_path, tree, must_name):
    path = write_params(tmp_path, tree)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert str(path) in message
    for words in must_name:
        assert words in message


def test_set_override_applies_and_is_validated(tmp_path):
    path = write_params(tmp_path, {"grpo": {"loss": {"beta": 0.04}}})
    cfg = load_config(path, ["grpo.loss.beta=0.5", "seed=7"])
    assert cfg.grpo.loss.beta == 0.5 and cfg.seed == 7
    with pytest.raises(ConfigError, match="unknown key grpo.loss.betaa"):
        load_config(path, ["grpo.loss.betaa=1"])
    with pytest.raises(ConfigError, match="expected section.key=value"):
        load_config(path, ["grpo.loss.beta"])


def test_set_values_are_yaml_and_reach_sections_the_file_leaves_out(tmp_path):
    """``--set`` reads its value as YAML (null, lists, ``off``) and sets keys of sections the params file does
    not write (their defaults otherwise)."""
    path = write_params(tmp_path, {"seed": 3})
    cfg = load_config(path, ["grpo.loss.beta=0.5", "model.lora.target_modules=[q_proj, v_proj]",
                             "eval.max_examples=null", "model.fast_paths=off"])
    assert cfg.grpo.loss.beta == 0.5 and cfg.model.lora.target_modules == ["q_proj", "v_proj"]
    assert cfg.eval.max_examples is None and cfg.model.fast_paths == "off"
    with pytest.raises(ConfigError, match="--set seed.x: 'seed' is a value, not a section"):
        load_config(path, ["seed.x=1"])


def test_a_bare_off_in_yaml_is_the_word_off(tmp_path):
    """YAML reads ``fast_paths: off`` as false; the config takes the word the user wrote."""
    path = tmp_path / "params.yaml"
    path.write_text("model:\n  fast_paths: off\n")
    assert load_config(path).model.fast_paths == "off"


def test_missing_params_file_says_how_to_fix(tmp_path):
    with pytest.raises(ConfigError, match="--params"):
        load_config(tmp_path / "nope.yaml")


@pytest.mark.parametrize("text", ["", "   \n\t\n", "# only a comment\n\n", "null\n"])
@pytest.mark.parametrize("extended", [False, True])
def test_an_empty_params_file_is_an_error_naming_it(tmp_path, text, extended, capsys):
    """Empty is a cut copy or a failed write more often than a choice: never silently all defaults, also
    when the empty file is the one a profile extends. The CLI reports it as a config error (exit 2)."""
    empty = tmp_path / "params.yaml"
    empty.write_text(text, encoding="utf-8")
    path = empty
    if extended:
        path = tmp_path / "profile.yaml"
        path.write_text("extends: params.yaml\nseed: 3\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=rf"{empty}: the params file is empty .* write `{{}}` in it"):
        load_config(path)
    assert main(["prepare", "--params", str(path)]) == 2
    assert f"error: {empty}: the params file is empty" in capsys.readouterr().err


def test_an_explicit_empty_mapping_is_all_defaults_and_says_so(tmp_path, capsys):
    path = tmp_path / "params.yaml"
    path.write_text("{}\n", encoding="utf-8")
    assert config_to_dict(load_config(path)) == config_to_dict(Config())
    assert f"{path}: {{}}: every value is the default" in capsys.readouterr().err


def test_config_is_frozen():
    cfg = config_from_dict({})
    with pytest.raises(ValidationError, match="frozen"):
        cfg.seed = 3  # type: ignore[misc]


def _key_paths(tree: dict, prefix: str = "") -> set[str]:
    """Every key of a nested dict as a dotted path (``grpo.loss.beta``), sections included."""
    paths = set()
    for key, value in tree.items():
        paths.add(prefix + str(key))
        if isinstance(value, dict):
            paths |= _key_paths(value, f"{prefix}{key}.")
    return paths


def test_every_default_is_the_value_params_yaml_ships():
    """One source of truth: ``Config()`` is the pipeline params.yaml documents, key for key: the same keys
    (loading fills a key params.yaml lacks from the code's default, so the values alone would not see it)
    with the same values."""
    shipped = yaml.safe_load((ROOT / "params.yaml").read_text(encoding="utf-8"))
    code, params = _key_paths(config_to_dict(Config())), _key_paths(shipped)
    assert not code - params, f"params.yaml lacks {sorted(code - params)}: add each with its default and a comment"
    assert not params - code, f"params.yaml has {sorted(params - code)}, which Config() does not know"
    assert config_to_dict(Config()) == config_to_dict(load_config(ROOT / "params.yaml"))


def test_a_profile_overlays_the_file_it_extends_key_by_key(tmp_path):
    base = tmp_path / "params.yaml"
    base.write_text("seed: 7\ngrpo:\n  lr: 0.5\n  loss:\n    beta: 0.1\n", encoding="utf-8")
    (tmp_path / "configs").mkdir()
    profile = tmp_path / "configs" / "small.yaml"
    profile.write_text("extends: ../params.yaml\ngrpo:\n  loss:\n    entropy_coef: 0.01\n", encoding="utf-8")
    cfg = load_config(profile, ["grpo.steps=3"])
    assert (cfg.seed, cfg.grpo.lr, cfg.grpo.loss.beta, cfg.grpo.loss.entropy_coef, cfg.grpo.steps) == (
        7, 0.5, 0.1, 0.01, 3)
    assert cfg.grpo.sampling == Config().grpo.sampling  # what neither file lists: the defaults
    profile.write_text("extends: ../params.yaml\ngrpo:\n  los:\n    beta: 0.2\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"small.yaml: unknown key grpo.los"):
        load_config(profile)
    base.write_text("extends: configs/small.yaml\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="extends` comes back"):
        load_config(profile)


def test_the_shipped_profiles_load(tmp_path):
    """Every profile loads; a GPU profile names a model folder the user provides (here an empty one)."""
    for profile in sorted((ROOT / "configs").glob("*.yaml")):
        tree = yaml.safe_load(profile.read_text(encoding="utf-8"))
        named = (tree.get("model") or {}).get("name_or_path") or ""
        overrides = [f"model.name_or_path={tmp_path}"] if named.startswith("/models/") else []
        if named in NAMED_SOURCES:
            try:
                named_source_file(named)
            except SourceError:  # the registry package is not installed: the profile says how to get it
                with pytest.raises(ConfigError, match=re.escape(NAMED_SOURCES[named].setup)):
                    load_config(profile)
                stand_in = tmp_path / "stand-in.gguf"
                stand_in.touch()
                overrides = [f"model.name_or_path={stand_in}"]
        assert load_config(profile, overrides).model_dump() != Config().model_dump(), profile


def _bounded_fields(model_cls, prefix=()):
    """(dotted path, "ge" | "gt" | "le" | "lt", bound, the field's default) of every bounded field of the tree."""
    import annotated_types
    from pydantic import BaseModel

    kinds = {annotated_types.Ge: "ge", annotated_types.Gt: "gt", annotated_types.Le: "le", annotated_types.Lt: "lt"}
    for name, field in model_cls.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            yield from _bounded_fields(field.annotation, (*prefix, name))
            continue
        for meta in field.metadata:
            if type(meta) in kinds:
                kind = kinds[type(meta)]
                yield (*prefix, name), kind, getattr(meta, kind), field.default


# Fields whose value at its bound needs a sibling to agree (the heads must divide by the key/value heads).
COMPANIONS = {("model", "tiny", "num_attention_heads"): {("model", "tiny", "num_key_value_heads"): 1}}


def _tree_with(values: dict[tuple, object]) -> dict:
    """The default params tree with ``values`` (path -> value) set in it."""
    from grpo.config import config_to_dict

    tree = config_to_dict(config_from_dict({}))
    for path, value in values.items():
        node = tree
        for key in path[:-1]:
            if node.get(key) is None:  # a section off by default
                node[key] = {}
            node = node[key]
        node[path[-1]] = value
    return tree


def test_every_bound_accepts_its_edge_and_refuses_one_step_past_it_by_name():
    """Each ``ge``/``gt``/``le``/``lt`` of the tree, read off the fields themselves: the value at the edge (or one
    step inside an open bound) loads, one step past it is refused naming the key. An integer steps by 1, a
    float by 1e-3. A bound dropped or not enforced fails here; a bound moved is read off the moved field,
    so the edges that follow from a key's meaning (``MEANINGLESS``, ``MEANINGFUL``) pin those."""
    fields = list(_bounded_fields(Config))
    assert len(fields) > 100, len(fields)
    for path, kind, bound, default in fields:
        step = 1 if isinstance(bound, int) and not isinstance(default, float) else 1e-3
        inside = {"ge": bound, "le": bound, "gt": bound + step, "lt": bound - step}[kind]
        outside = {"ge": bound - step, "le": bound + step, "gt": bound, "lt": bound}[kind]
        key = ".".join(path)
        config_from_dict(_tree_with({path: inside, **COMPANIONS.get(path, {})}))
        with pytest.raises(ConfigError, match=re.escape(key)):
            config_from_dict(_tree_with({path: outside, **COMPANIONS.get(path, {})}))


# Edges that follow from what a key means, not from the value its bound happens to have: a count of zero,
# a negative slack, a reward outside the [-1, +1] the rewards span are refused; zero boundary steps (the
# checks off), a zero slack and the rewards' own ends load.
MEANINGLESS = [
    ("data.n_train", 0), ("data.n_eval", 0), ("data.checks.max_context_chars", 0),
    ("data.checks.max_question_chars", 0), ("data.checks.max_answer_chars", 0), ("data.checks.max_examples", 0),
    ("data.checks.balance_z", -0.5), ("eval.diagnose.prompts", 0), ("eval.batch_size", 0), ("eval.max_examples", 0),
    ("eval.diagnose.kl_warn", -0.5), ("model.tiny.num_hidden_layers", 0), ("model.lora.r", 0), ("model.lora.alpha", 0),
    ("monitor.kind_trade.window", 0), ("rewards.abstain_when_answered.fairness", 1.5),
    ("rewards.abstain_when_answered.hallucination", -1.5), ("sft.epochs", 0), ("sft.batch_size", 0),
    ("pretrain.epochs", 0), ("grpo.sampling.max_new_tokens", 0), ("grpo.sampling.temperature", 0.0),
    ("grpo.selection.every", 0), ("grpo.steps", 0), ("grpo.prompts_per_step", 0), ("grpo.num_iterations", 0),
    ("grpo.grad_accum", 0), ("checkpoint.keep_last", 0),
]
MEANINGFUL = [
    ("monitor.boundary_steps", 0), ("data.checks.balance_z", 0.0), ("eval.diagnose.kl_warn", 0.5),
    ("rewards.abstain_when_answered.fairness", 1.0), ("rewards.abstain_when_answered.hallucination", 1.0),
    ("rewards.abstain_when_answered.fairness", -1.0), ("model.lora.r", 1), ("eval.max_examples", 1),
    ("pretrain.records", 0), ("grpo.sampling.min_new_tokens", 0), ("grpo.max_resample", 0), ("grpo.group_size", 2),
]


def test_the_edge_tables_name_keys_of_the_tree():
    """Else "unknown key" would pass for a refusal."""
    def leaves(model_cls, prefix=""):
        for name, field in model_cls.model_fields.items():
            if isinstance(field.annotation, type) and hasattr(field.annotation, "model_fields"):
                yield from leaves(field.annotation, f"{prefix}{name}.")
            else:
                yield prefix + name

    assert {key for key, _ in MEANINGLESS + MEANINGFUL} <= set(leaves(Config))


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_the_vllm_engine_is_refused_where_vllm_is_not_installed():
    with pytest.raises(ConfigError, match=r"grpo\.rollout\.engine.*use the default engine hf"):
        config_from_dict({"grpo": {"rollout": {"engine": "vllm"}}})


@pytest.mark.parametrize(("key", "value"), MEANINGLESS)
def test_a_value_the_key_cannot_mean_is_refused_by_name(key, value):
    with pytest.raises(ConfigError, match=re.escape(key)):
        config_from_dict(_tree_with({tuple(key.split(".")): value}))


@pytest.mark.parametrize(("key", "value"), MEANINGFUL)
def test_a_meaningful_edge_value_loads(key, value):
    cfg = config_from_dict(_tree_with({tuple(key.split(".")): value}))
    node = cfg
    for part in key.split("."):
        node = getattr(node, part)
    assert node == value
