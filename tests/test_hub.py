"""Models named by Hugging Face Hub id, without the network: a Hub cache laid out on disk the
way ``huggingface_hub`` lays it out (``raypp.testing.hub_cache``), ``HF_HUB_OFFLINE=1`` and
``HF_HUB_CACHE`` pointing at it. A Hub id generates what the same checkpoint does by path;
a local path wins over a Hub id; every way a Hub id can fail is one clear error (and one
line, exit 2, on the command line)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from raypp.model_source import HubModel, ModelNotFoundError, resolve_model, stage_checkpoint
from raypp.testing.hub_cache import add_model_dir_to_hub_cache, add_to_hub_cache

REPO = "raypp-test/tiny-llama"
GGUF_REPO = "raypp-test/SmolLM2-135M-Instruct-GGUF"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def hub(tmp_path_factory, tiny_llama):
    """A hub cache holding the tiny Llama (``main``, and ``v2`` with other sampling
    defaults), repos with its config only and its tokenizer only, and the demo GGUF inside
    a repo (when fetched)."""
    from raypp.config import cache_dir
    from raypp.demo import demo_model_path

    cache = tmp_path_factory.mktemp("hub")
    commits = {"main": add_model_dir_to_hub_cache(cache, REPO, tiny_llama)}
    v2 = tmp_path_factory.mktemp("v2") / "model"
    shutil.copytree(tiny_llama, v2)
    (v2 / "generation_config.json").write_text(json.dumps({"temperature": 0.3}))
    commits["v2"] = add_model_dir_to_hub_cache(cache, REPO, v2, revision="v2")
    add_to_hub_cache(cache, "raypp-test/config-only", {"config.json": tiny_llama / "config.json"})
    add_to_hub_cache(cache, "raypp-test/tokenizer-only",
                     {"tokenizer.json": tiny_llama / "tokenizer.json"})
    try:
        gguf = demo_model_path(cache_dir(), fetch=False)
    except FileNotFoundError:
        gguf = None
    else:
        generation = tmp_path_factory.mktemp("gguf_repo") / "generation_config.json"
        generation.write_text(json.dumps({"temperature": 0.7, "top_p": 0.9}))
        add_to_hub_cache(cache, GGUF_REPO, {GGUF_NAME: gguf, "generation_config.json": generation},
                         link=True)
    return cache, commits, gguf


@pytest.fixture
def offline(monkeypatch, hub):
    """This process as if started with HF_HUB_OFFLINE=1 and HF_HUB_CACHE=<the cache>:
    huggingface_hub reads both when first imported, so its constants are set too."""
    from huggingface_hub import constants

    cache = str(hub[0])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", cache)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", cache)
    return hub


def _snapshot(cache: Path, repo_id: str, commit: str) -> Path:
    return cache / ("models--" + repo_id.replace("/", "--")) / "snapshots" / commit


# -- resolving ----------------------------------------------------------------------------------
def test_a_hub_id_resolves_to_its_cached_snapshot_offline(offline, tmp_path):
    from raypp.model_config import ModelConfig

    cache, commits, _ = offline
    source = resolve_model(REPO, tmp_path)
    assert source.path == _snapshot(cache, REPO, commits["main"])
    assert source.hub == HubModel(REPO, commits["main"], None)
    config = ModelConfig(REPO, cache_dir=str(tmp_path))
    assert config.model == str(source.path.resolve()) and config.hub == source.hub
    assert config.architecture == "LlamaForCausalLM"


def test_revision_names_a_branch_or_a_commit(offline, tmp_path, tiny_llama):
    from raypp.model_config import ModelConfig

    cache, commits, _ = offline
    assert resolve_model(REPO, tmp_path, revision="v2").hub.commit == commits["v2"]
    assert ModelConfig(REPO, revision="v2").sampling_defaults == {"temperature": 0.3}
    by_commit = resolve_model(REPO, tmp_path, revision=commits["main"])
    assert by_commit.path == _snapshot(cache, REPO, commits["main"])
    with pytest.raises(ModelNotFoundError, match="at revision 'nope' is not in the Hugging Face cache"):
        resolve_model(REPO, tmp_path, revision="nope")
    with pytest.raises(ValueError, match="applies to Hugging Face Hub ids only.*local path"):
        resolve_model(str(tiny_llama), tmp_path, revision="v2")


def test_a_local_path_wins_over_the_hub_id_of_the_same_spelling(offline, tmp_path, tiny_llama,
                                                                 monkeypatch):
    (tmp_path / "raypp-test").mkdir()
    (tmp_path / REPO).symlink_to(tiny_llama, target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    source = resolve_model(REPO, tmp_path)
    assert source.hub is None and source.path.resolve() == tiny_llama.resolve()


def test_an_uncached_id_offline_says_what_was_tried_and_what_to_do(offline, tmp_path):
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("raypp-test/not-cached", tmp_path)
    message = str(info.value)
    assert "no local file or directory" in message and "tried the Hugging Face Hub" in message
    assert "not in the Hugging Face cache" in message and "HF_HUB_OFFLINE=1" in message
    assert str(offline[0]) in message


def test_a_name_that_is_neither_a_path_nor_a_hub_id(tmp_path):
    for name in ("./no/such/model", "/no/such/model", "a/b/c", "org--x/y"):
        with pytest.raises(ModelNotFoundError, match="no such file or directory, and not a "
                                                     "Hugging Face Hub id"):
            resolve_model(name, tmp_path)


def test_a_cached_repo_that_is_no_model_is_named(offline, tmp_path):
    with pytest.raises(ModelNotFoundError, match="has no model.safetensors"):
        resolve_model("raypp-test/config-only", tmp_path)
    with pytest.raises(ModelNotFoundError, match="has no config.json.*name one: "
                                                 "raypp-test/tokenizer-only/FILE.gguf"):
        resolve_model("raypp-test/tokenizer-only", tmp_path)


def test_hub_errors_say_which_and_what_to_do(monkeypatch, tmp_path):
    """The online failures, with huggingface_hub's own exception types."""
    import huggingface_hub
    from huggingface_hub import utils

    def failing(error: type[Exception]):
        def snapshot_download(*args, **kwargs):
            e = error.__new__(error)
            Exception.__init__(e, "from the Hub")
            raise e
        return snapshot_download

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    for error, expected in ((utils.GatedRepoError, "is gated: accept its terms"),
                            (utils.RepositoryNotFoundError, "it has no repo 'org/x'.*HF_TOKEN"),
                            (utils.RevisionNotFoundError, "has no revision 'v9'"),
                            (utils.LocalEntryNotFoundError, "could not be reached.*not cached")):
        monkeypatch.setattr(huggingface_hub, "snapshot_download", failing(error))
        with pytest.raises(ModelNotFoundError, match=expected):
            resolve_model("org/x", tmp_path, revision="v9")


def test_the_files_fetched_from_a_repo():
    """Only what an engine reads: no GGUF, no original/ or consolidated weights, no docs."""
    from huggingface_hub.utils import filter_repo_objects

    from raypp.model_source import _HF_SKIPPED, HF_FILES

    listing = ["config.json", "generation_config.json", "model-00001-of-00002.safetensors",
               "model-00002-of-00002.safetensors", "model.safetensors.index.json",
               "consolidated.safetensors", "original/consolidated.00.pth", "original/params.json",
               "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
               "special_tokens_map.json", "chat_template.jinja", "README.md", ".gitattributes",
               "model.Q4_K_M.gguf", "onnx/model.safetensors"]
    fetched = set(filter_repo_objects(listing, allow_patterns=list(HF_FILES),
                                      ignore_patterns=list(_HF_SKIPPED)))
    assert fetched == {"config.json", "generation_config.json", "model-00001-of-00002.safetensors",
                       "model-00002-of-00002.safetensors", "model.safetensors.index.json",
                       "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                       "special_tokens_map.json", "chat_template.jinja"}


def test_a_gguf_file_inside_a_hub_repo(offline, tmp_path):
    from raypp.model_config import ModelConfig

    cache, _, gguf = offline
    if gguf is None:
        pytest.skip("the demo GGUF is not fetched (make setup fetches it)")
    config = ModelConfig(f"{GGUF_REPO}/{GGUF_NAME}")
    assert config.model.endswith(GGUF_NAME) and config.gguf is not None
    assert config.model.startswith(str(cache.resolve()))
    assert config.hub.filename == GGUF_NAME
    assert config.sampling_defaults == {"temperature": 0.7, "top_p": 0.9}  # the repo's file
    with pytest.raises(ModelNotFoundError, match="has no file 'other.gguf'"):
        resolve_model(f"{GGUF_REPO}/other.gguf", tmp_path)
    with pytest.raises(ModelNotFoundError, match=f"has no config.json.*{GGUF_REPO}/FILE.gguf"):
        resolve_model(GGUF_REPO, tmp_path)


def test_a_stage_on_a_node_without_the_drivers_path(offline, tmp_path):
    """A node that shares no disk with the driver: a Hub model comes from its own cache at
    the driver's commit; a local path is refused saying what to do."""
    cache, commits, _ = offline
    hub = HubModel(REPO, commits["v2"])
    path = stage_checkpoint(str(tmp_path / "elsewhere" / "snapshot"), hub)
    assert path == str(_snapshot(cache, REPO, commits["v2"]))
    here = str(_snapshot(cache, REPO, commits["main"]))
    assert stage_checkpoint(here, hub) == here
    with pytest.raises(ModelNotFoundError, match="does not exist on node .*Hub id"):
        stage_checkpoint(str(tmp_path / "missing"), None)


# -- generating ---------------------------------------------------------------------------------
def test_llm_by_hub_id_generates_what_the_path_does(ray_cluster, offline, tiny_llama):
    from raypp import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = ["The list type", "Python is"]
    outputs = []
    for model in (REPO, str(tiny_llama)):
        with LLM(model, pipeline_parallel_size=2, max_model_len=64) as llm:
            outputs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
    assert outputs[0] == outputs[1] and all(len(t) == 12 for t in outputs[0])


# -- the command line ---------------------------------------------------------------------------
def _raypp(*argv: str, cache: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RAYPP_LOG_LEVEL", "RAY_ADDRESS")}
    env.update(HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(cache))
    return subprocess.run([sys.executable, "-m", "raypp", *argv], capture_output=True, text=True,
                          env=env, timeout=300)


def test_cli_offline_and_not_cached_is_one_line_and_exit_2(hub):
    done = _raypp("generate", "raypp-test/not-cached", "--prompt", "x", cache=hub[0])
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("raypp: error: "), done.stderr
    assert "'raypp-test/not-cached'" in lines[0] and "HF_HUB_OFFLINE=1" in lines[0]


def test_cli_fetch_prints_the_snapshot_of_a_revision(hub):
    cache, commits, _ = hub
    done = _raypp("fetch", REPO, "--revision", "v2", cache=cache)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(_snapshot(cache, REPO, commits["v2"]).resolve())


def test_revision_reaches_the_engine_options():
    from raypp.cli import build_parser
    from raypp.entrypoints.args import engine_kwargs

    for command in (["generate"], ["serve"], ["bench", "throughput"]):
        args = build_parser().parse_args([*command, REPO, "--revision", "v2"])
        assert engine_kwargs(args)["revision"] == "v2"
        assert "revision" not in engine_kwargs(build_parser().parse_args([*command, REPO]))
