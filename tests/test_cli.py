"""The command line: engine options reach ``LLM(...)`` through the real parser; a model is
named the same way by every command; user errors are one line and exit code 2 (the real
``raypp`` in a subprocess); ``--help`` documents every option with its default."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from raypp.cli import build_parser
from raypp.entrypoints.args import engine_kwargs, model_name

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
    with LLM(model_name(args), **engine_kwargs(args)) as llm:
        config = llm.engine.config
        assert config.stage_layers() == [(0, 4), (4, 6)]
        assert config.runtime.enforce_eager is True
        assert config.runtime.step_timeout_s == 30.0
        out = llm.generate(["The list type"], SamplingParams(temperature=0, max_tokens=4),
                           use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4


# -- one way to name a model --------------------------------------------------------------------
@pytest.mark.parametrize("command", [["generate"], ["serve"], ["bench", "throughput"],
                                     ["bench", "latency"], ["fetch"]])
def test_every_model_command_takes_the_model_either_way(command):
    parse = build_parser().parse_args
    assert model_name(parse([*command, "/m"])) == "/m"
    assert model_name(parse([*command, "--model", "/m"])) == "/m"
    assert model_name(parse([*command, "/m", "--model", "/m"])) == "/m"
    assert model_name(parse([*command, "demo"])) == model_name(parse([*command, "--demo"])) == "demo"


def test_two_different_models_or_none_is_a_usage_error():
    from raypp.entrypoints.args import UsageError

    parse = build_parser().parse_args
    with pytest.raises(UsageError, match="two different models"):
        model_name(parse(["generate", "/a", "--model", "/b"]))
    with pytest.raises(UsageError, match="give a model: raypp serve MODEL"):
        model_name(parse(["serve"]))
    assert model_name(parse(["bench", "throughput"]), default="demo") == "demo"


def test_generate_runs_the_model_named_either_way(ray_cluster, tiny_llama, capsys):
    """The positional MODEL and --model start the same model and print the same text."""
    from raypp.cli import main

    printed = []
    for argv in (["generate", str(tiny_llama)], ["generate", "--model", str(tiny_llama)]):
        assert main([*argv, "--prompt", "The list type", "--max-tokens", "4",
                     "--temperature", "0", "--max-model-len", "64"]) == 0
        printed.append(capsys.readouterr().out)
    assert printed[0] == printed[1]
    assert printed[0].startswith("--- 'The list type'\nThe list type")  # no chat template


def test_serve_runs_the_model_named_with_model_and_serves_it_by_that_name(tiny_llama):
    """A real ``raypp serve --model DIR`` in its own process: healthy, and /v1/models names
    the model as it was given."""
    import socket
    import time
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.Popen([sys.executable, "-m", "raypp", "serve", "--model", str(tiny_llama),
                             "--port", str(port), "--max-model-len", "64"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.2)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10) as r:
            assert [m["id"] for m in json.load(r)["data"]] == [str(tiny_llama)]
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)


# -- --help ---------------------------------------------------------------------------------------
def _parsers(parser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                yield from _parsers(child)


def test_every_option_has_help_and_help_shows_defaults():
    parsers = list(_parsers(build_parser()))
    for parser in parsers:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                continue
            assert action.help, f"{parser.prog}: {action.option_strings or action.dest} has no help"
    generate = next(p for p in parsers if p.prog == "raypp generate").format_help()
    assert "number of pipeline stages (Ray actors) (default: 1)" in " ".join(generate.split())
    assert "(default: 64)" in generate and "(default: auto)" in generate


def test_help_lists_commands_without_importing_them():
    """``raypp --help`` names every command with the help its module gives it, and loads
    none of them (nor torch)."""
    code = ("import sys\nfrom raypp.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in sys.modules if m in ('torch', 'ray') or "
            "m.startswith('raypp.entrypoints') or m.startswith('raypp.bench')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip().splitlines()[-1] == "[]"
    assert "generate  generate text for one or more prompts" in done.stdout

    def helps(parser):
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        return {a.dest: a.help for a in sub._choices_actions}

    assert helps(build_parser(full=[])) == helps(build_parser())


# -- user errors: one line, exit 2 -----------------------------------------------------------------
def _raypp(*argv: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "RAYPP_LOG_LEVEL"}
    return subprocess.run([sys.executable, "-m", "raypp", *argv], capture_output=True, text=True,
                          env={**environ, **env}, timeout=300)


def _one_line_error(done: subprocess.CompletedProcess, *expected: str) -> str:
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("raypp: error: ") and "Traceback" not in done.stderr
    for text in expected:
        assert text in lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def bad_models(tmp_path_factory, tiny_llama):
    root = tmp_path_factory.mktemp("bad_models")
    (root / "garbage.gguf").write_bytes(b"not a gguf file at all" * 10)
    unsupported = root / "gpt2"
    shutil.copytree(tiny_llama, unsupported)
    config = json.loads((unsupported / "config.json").read_text())
    config.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (unsupported / "config.json").write_text(json.dumps(config))
    return root


@pytest.mark.parametrize("case", ["no model", "missing", "not a model", "bad gguf",
                                  "unsupported", "too many stages", "two models", "bad value"])
def test_user_errors_are_one_line_and_exit_2(case, tiny_llama, bad_models):
    readme = str(Path(__file__).resolve().parents[1] / "README.md")
    argv, expected = {
        "no model": (["generate"], ["give a model: raypp generate MODEL", "'demo'"]),
        "missing": (["serve", "/no/such/model"], ["'/no/such/model' not found", "'demo'"]),
        "not a model": (["generate", "--model", readme], ["is a file but not a GGUF file"]),
        "bad gguf": (["generate", str(bad_models / "garbage.gguf")], ["garbage.gguf"]),
        "unsupported": (["generate", str(bad_models / "gpt2")], ["GPT2LMHeadModel",
                                                                 "LlamaForCausalLM"]),
        "too many stages": (["generate", str(tiny_llama), "-pp", "9"], ["6 layers"]),
        "two models": (["serve", str(tiny_llama), "--model", "demo"], ["two different models"]),
        "bad value": (["generate", str(tiny_llama), "--step-timeout-s", "0"],
                      ["step_timeout_s must be > 0"]),
    }[case]
    _one_line_error(_raypp(*argv), *expected)


def test_request_errors_are_found_before_anything_starts(tiny_llama):
    """An empty prompt, or max_tokens beyond the context, fails before Ray starts."""
    empty = _raypp("generate", str(tiny_llama), "--prompt", "")
    _one_line_error(empty, "--prompt is empty")
    over = _raypp("generate", str(tiny_llama), "--max-model-len", "32", "--max-tokens", "100",
                  "--prompt", "The list type")
    line = _one_line_error(over, "max_tokens=100", "max_model_len is 32")
    assert "starting a local Ray cluster" not in over.stderr and "so at most" in line


@pytest.mark.parametrize("how", [("--debug",), ("RAYPP_LOG_LEVEL", "DEBUG")])
def test_debug_shows_the_traceback(how):
    done = (_raypp("generate", "/no/such/model", "--debug") if len(how) == 1
            else _raypp("generate", "/no/such/model", **{how[0]: how[1]}))
    assert done.returncode == 2
    assert "Traceback" in done.stderr and "ModelNotFoundError" in done.stderr
    assert done.stderr.rstrip().splitlines()[-1].startswith("raypp: error: ")


def test_fetch_prints_the_local_path(tiny_llama):
    done = _raypp("fetch", str(tiny_llama))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(tiny_llama.resolve())


# -- `raypp serve` without the server's extra (issue 29) -----------------------------------------
_WITHOUT_FASTAPI = ("import sys; sys.modules['fastapi'] = None; from raypp.cli import main; "
                    "sys.exit(main(sys.argv[1:]))")  # fastapi cannot be imported: a slim install


def _raypp_without_server_extra(*args: str):
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
