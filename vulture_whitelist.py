"""Names vulture cannot see used: pydantic fields and validators, framework hooks, pytest markers.

Read by `make lint` (vulture grpo tasks flows tests benchmarks vulture_whitelist.py); never imported.
"""

invariant  # variable in grpo/checks/preflight.py
_._group_of_two  # method in grpo/config/
_._none_or_a_group  # method in grpo/config/
_._known_time_zone  # method in grpo/config/
_._heads_divide  # method in grpo/config/
_._local_path_exists  # method in grpo/config/
_._positive_temperature  # method in grpo/config/
boundary_clipped  # variable in grpo/config/
boundary_empty  # variable in grpo/config/
boundary_entropy_high  # variable in grpo/config/
boundary_entropy_low  # variable in grpo/config/
cls  # variable in grpo/config/
fairness  # variable in grpo/config/
fairness_path  # variable in grpo/config/
fairness_source  # variable in grpo/config/
hallucination  # variable in grpo/config/
hallucination_path  # variable in grpo/config/
hallucination_source  # variable in grpo/config/
lengths_frozen  # variable in grpo/config/
max_prob  # variable in grpo/config/
model_config  # variable in grpo/config/
reward_zero_std  # variable in grpo/config/
step_time  # variable in grpo/config/
template_id  # variable in grpo/data/schema.py
_.progress_bars  # attribute in grpo/data/validate.py
exc_info  # variable in grpo/health/metrics.py
_.decoder  # attribute in grpo/model/tiny.py
_.pre_tokenizer  # attribute in grpo/model/tiny.py
defect  # variable in tests/test_data_validate.py
harness  # function in tests/test_flows.py
fresh_checks  # fixture in tests/test_fast_paths.py (pytest.mark.usefixtures)
pytestmark  # variable in tests/test_flows.py
_._path_matches_source  # method in grpo/config/
_._categories_of_bbq  # method in grpo/config/
_._one_model_source  # method in grpo/config/
_._loadable_offline  # method in grpo/config/
_._off_as_written  # method in grpo/config/
_._vllm_installed  # method in grpo/config/
_.on_step_begin  # TrainerCallback hook in benchmarks/workers.py
_.on_step_end  # TrainerCallback hook in benchmarks/workers.py
_.on_log  # TrainerCallback hook in benchmarks/workers.py
control  # TrainerCallback hook argument in benchmarks/workers.py
_.post_processor  # attribute of a tokenizers.Tokenizer set in grpo/model/gguf.py
_.forward  # nn.Module.forward of grpo/model/precision.py's Fp32Head (called by the module)
cache_kwargs  # argument in grpo/model/fast/decode.py (ReservedLayer.update keeps DynamicLayer.update's signature)
_.longrepr  # pytest report attribute set in tests/conftest.py (an unmarked shared-folder skip fails)
pytest_runtest_makereport  # pytest hook in tests/conftest.py
_.create_module  # importlib Loader hook in tools/mutation_sweep.py
_.submodule_search_locations  # ModuleSpec attribute set in tools/mutation_sweep.py
outside_a_run  # pytest fixture in tests/test_task_stages.py (requested by name)
return_state  # keyword the flow passes its tasks, kept by the stand-ins in tests/test_flow_wiring.py
_.repetition_penalty  # generation_config field set in tests/test_decode.py (the library must ignore it)
_.no_repeat_ngram_size  # generation_config field set in tests/test_decode.py (the library must ignore it)
_.attention_dropout  # LlamaAttention attribute set in tests/test_rollout.py (eval mode must switch it off)
