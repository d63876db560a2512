"""The config package: every option declared once (help and choices), the names the config accepts
equal to what the implementing packages provide, and the CLI built from the declarations."""

from __future__ import annotations

import dataclasses

import pytest

from kvflow.config import (
    FAIRNESS_MODES,
    ROUTER_POLICIES,
    SCHEDULING_POLICIES,
    TOOL_CALL_PARSERS,
    EngineConfig,
    ServerConfig,
)


@pytest.mark.parametrize("cls", [EngineConfig, ServerConfig])
def test_every_option_declares_its_help(cls):
    for f in dataclasses.fields(cls):
        assert f.metadata.get("help"), f"{cls.__name__}.{f.name} has no help text"


def test_scheduling_names_are_what_core_implements():
    from kvflow.core.sched import SchedulingPolicy, make_policy
    from kvflow.core.step_cost import StepCostModel

    for name in SCHEDULING_POLICIES:
        assert isinstance(make_policy(name, StepCostModel(), 512, 10.0, 2.0), SchedulingPolicy)
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, priority, slo"):
        make_policy("lottery", StepCostModel(), 512, 10.0, 2.0)
    assert FAIRNESS_MODES == ("none", "vtc")


def test_tool_parser_names_are_what_the_server_implements():
    from kvflow.entrypoints.openai.tool_parsers import FORMATS, get_tool_format

    assert set(TOOL_CALL_PARSERS) == {"auto", *FORMATS}
    for name in FORMATS:
        assert get_tool_format(name, None).name == name


def test_router_policy_names_are_what_the_router_implements():
    from kvflow.router.policies import DATA_PARALLEL_POLICIES

    assert set(ROUTER_POLICIES) == set(DATA_PARALLEL_POLICIES)


@pytest.mark.parametrize(
    "field,bad",
    [
        ("dtype", "float8"),
        ("kv_cache_dtype", "fp4"),
        ("attention_backend", "flash"),
        ("scheduling_policy", "lottery"),
        ("fairness", "drr"),
        ("distributed_executor_backend", "slurm"),
        ("quantization", "int2"),
    ],
)
def test_a_bad_choice_names_the_option_and_the_accepted_values(field, bad):
    choices = next(f for f in dataclasses.fields(EngineConfig) if f.name == field).metadata["choices"]
    with pytest.raises(ValueError) as e:
        EngineConfig(**{field: bad})
    msg = str(e.value)
    assert msg.startswith(f"{field} must be one of") and repr(bad) in msg
    assert all(str(c) in msg for c in choices if c is not None)


def test_cli_flags_carry_the_declared_help_and_choices():
    import argparse

    from kvflow.cli.engine_args import add_engine_args, engine_config_from_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    actions = {a.dest: a for a in p._actions}
    for f in dataclasses.fields(EngineConfig):
        action = actions[f.name]
        assert action.help.startswith(f.metadata["help"])
        if f.metadata["choices"] and action.metavar is not None:
            assert set(action.metavar.strip("{}").split(",")) == {str(c) for c in f.metadata["choices"] if c}
    cfg = engine_config_from_args(
        p.parse_args(["--dtype", "bfloat16", "--scheduling-policy", "slo", "--no-enable-prefix-caching"])
    )
    assert (cfg.dtype, cfg.scheduling_policy, cfg.enable_prefix_caching) == ("bfloat16", "slo", False)
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        engine_config_from_args(p.parse_args(["--scheduling-policy", "lottery"]))
