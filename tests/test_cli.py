"""The command line: engine options reach ``LLM(...)`` through the real parser."""

from __future__ import annotations

import pytest

from raypp.cli import build_parser
from raypp.entrypoints.args import engine_kwargs

NEW_OPTIONS = ["--layer-partition", "3,2,2", "--enforce-eager", "--step-timeout-s", "7.5",
               "--workers-per-gpu", "3"]


@pytest.mark.parametrize("command", [
    ["generate", "--demo"], ["serve", "--demo"], ["bench", "throughput", "--demo"],
    ["bench", "latency", "--demo"],
])
def test_every_engine_command_takes_the_runtime_options(command):
    kwargs = engine_kwargs(build_parser().parse_args([*command, "-pp", "3", *NEW_OPTIONS]))
    assert kwargs["pipeline_parallel_size"] == 3
    assert kwargs["layer_partition"] == [3, 2, 2]
    assert kwargs["enforce_eager"] is True
    assert kwargs["step_timeout_s"] == 7.5
    assert kwargs["workers_per_gpu"] == 3


def test_options_left_out_keep_their_environment_defaults():
    kwargs = engine_kwargs(build_parser().parse_args(["generate", "--demo"]))
    assert not {"layer_partition", "enforce_eager", "step_timeout_s", "workers_per_gpu"} & set(kwargs)


def test_a_malformed_layer_partition_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["generate", "--demo", "--layer-partition", "3;2"])
    assert exit_info.value.code == 2
    assert 'layer partition must look like "3,2,2"' in capsys.readouterr().err


def test_invalid_values_are_refused_by_the_engine_config(tiny_llama):
    from raypp import LLM

    def llm_from(*argv: str) -> None:
        LLM(str(tiny_llama), **engine_kwargs(build_parser().parse_args(["generate", *argv])))

    with pytest.raises(ValueError, match="partition"):
        llm_from("-pp", "3", "--layer-partition", "3,2")  # sums to 5 of 6 layers
    with pytest.raises(ValueError, match="step_timeout_s must be > 0"):
        llm_from("--step-timeout-s", "0")
    with pytest.raises(ValueError, match="workers_per_gpu=2 places workers on GPUs"):
        llm_from("--device", "cpu", "--workers-per-gpu", "2")


def test_the_options_reach_the_engine(ray_cluster, tiny_llama):
    from raypp import LLM, SamplingParams

    args = build_parser().parse_args(["generate", "--model", str(tiny_llama), "-pp", "2",
                                      "--layer-partition", "4,2", "--enforce-eager",
                                      "--step-timeout-s", "30", "--max-model-len", "64"])
    with LLM(args.model, **engine_kwargs(args)) as llm:
        config = llm.engine.config
        assert config.stage_layers() == [(0, 4), (4, 6)]
        assert config.runtime.enforce_eager is True
        assert config.runtime.step_timeout_s == 30.0
        out = llm.generate(["The list type"], SamplingParams(temperature=0, max_tokens=4),
                           use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4


# -- `raypp serve` without the server's extra (issue 29) -----------------------------------------
_WITHOUT_FASTAPI = ("import sys; sys.modules['fastapi'] = None; from raypp.cli import main; "
                    "sys.exit(main(sys.argv[1:]))")  # fastapi cannot be imported: a slim install


def _raypp_without_server_extra(*args: str):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-c", _WITHOUT_FASTAPI, *args], capture_output=True,
                          text=True, timeout=120)


def test_serve_is_listed_and_names_the_install_command_without_the_server_extra():
    listed = _raypp_without_server_extra("--help")
    assert listed.returncode == 0 and "serve" in listed.stdout
    run = _raypp_without_server_extra("serve", "--demo", "--port", "8123")
    assert run.returncode == 1
    assert "pip install 'raypp[serve]'" in run.stderr and "invalid choice" not in run.stderr


def test_unknown_options_stay_usage_errors_and_serve_takes_a_tool_call_parser(capsys):
    from raypp.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--demo", "--no-such-option"])
    assert exit_info.value.code == 2 and "--no-such-option" in capsys.readouterr().err
    args = build_parser().parse_args(["serve", "--demo", "--tool-call-parser", "mistral"])
    assert args.tool_call_parser == "mistral"
