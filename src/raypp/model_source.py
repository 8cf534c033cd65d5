"""What a model name means: the one place a name becomes a local checkpoint path.

Every way of naming a model goes through :func:`resolve_model` — ``LLM(model)``, the
``MODEL`` argument and ``--model`` of every command, ``raypp fetch`` — so a name means
the same everywhere. A name is, in this order:

1. an existing local path: a Hugging Face–format directory, a ``.gguf`` file, or a
   directory holding one ``.gguf`` (which of these :class:`raypp.model_config.ModelConfig`
   decides). A local path always wins over a Hub id of the same spelling;
2. :data:`DEMO` (``"demo"``): the demo model, SmolLM2-135M-Instruct's GGUF file,
   fetched into the cache on first use (:mod:`raypp.demo`);
3. a Hugging Face Hub id: ``org/name`` (a Hugging Face–format repo: only the files an
   engine reads are fetched, :data:`HF_FILES`), or ``org/name/FILE.gguf`` (one GGUF file
   of a repo, with the repo's ``generation_config.json`` if it has one). It is fetched
   by ``huggingface_hub`` into its own cache (``HF_HUB_CACHE``, else ``HF_HOME/hub``,
   else ``~/.cache/huggingface/hub``) at ``revision`` (a branch, tag or commit; default
   ``main``), with its token (``HF_TOKEN`` or ``huggingface-cli login``); with
   ``HF_HUB_OFFLINE=1`` it is answered from that cache alone. ``huggingface_hub`` reads
   these variables when it is first imported; its network waits are bounded by its
   ``HF_HUB_ETAG_TIMEOUT`` and ``HF_HUB_DOWNLOAD_TIMEOUT`` (10 s each by default).

Anything else raises :class:`ModelNotFoundError` (a ``FileNotFoundError``) saying what
was tried; a Hub id that cannot be had (unknown, gated without a token, not cached while
offline or unreachable, no such revision or file, not a model) raises it saying which
and what to do. ``revision`` with a name that is not a Hub id is a ``ValueError``.

The driver resolves a name once (:class:`ModelSource`); stages load from its ``path``.
A stage on a node where that path does not exist (a cluster whose nodes share no disk)
calls :func:`stage_checkpoint`: a Hub model is fetched there into that node's own cache
at the same commit the driver resolved; a local path is an error saying to put it on a
disk every node reads, or to name the model by its Hub id.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

DEMO = "demo"
KINDS = (f"a Hugging Face–format directory (config.json + *.safetensors + tokenizer), "
         f"a .gguf file, {DEMO!r} (the demo model), or a Hugging Face Hub id (org/name, or "
         f"org/name/FILE.gguf)")

# The files of a Hugging Face–format repo an engine reads: config, weights (raypp reads
# model.safetensors or the sharded index; Mistral's consolidated copy and files in
# subfolders are skipped), tokenizer, chat template, generation config.
HF_FILES = ("config.json", "generation_config.json", "*.safetensors",
            "model.safetensors.index.json", "tokenizer*", "special_tokens_map.json",
            "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "chat_template.*")
_HF_SKIPPED = ("*/*", "consolidated*.safetensors")
# A repo id as the Hub spells one: "name" or "org/name" ("--" and ".." are not allowed).
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}(/[A-Za-z0-9][\w.-]{0,95})?")


class ModelNotFoundError(FileNotFoundError):
    """A model name that is no local path, no name raypp knows, or a Hub id that cannot
    be had (the message says which)."""


@dataclass(frozen=True)
class HubModel:
    """A model on the Hugging Face Hub as the driver resolved it: the repo, the commit its
    revision named then (so every node loads the same files), and the GGUF file in it
    (``None``: a Hugging Face–format repo)."""

    repo_id: str
    commit: str
    filename: str | None = None


@dataclass(frozen=True)
class ModelSource:
    """A resolved model name: the local path, and where it came from on the Hub (``None``
    for a local path or the demo)."""

    path: Path
    hub: HubModel | None = None


def resolve_model(name: str, cache_dir: str | Path, fetch: bool = True,
                  revision: str | None = None) -> ModelSource:
    """The local path ``name`` stands for (not yet checked to be a model: see
    :class:`~raypp.model_config.ModelConfig`). ``cache_dir`` is where raypp's own fetched
    models live (the demo); ``fetch=False`` fetches nothing (the demo missing raises
    ``FileNotFoundError``, a Hub id is answered from the Hub cache alone). ``revision``
    (a Hub id's branch, tag or commit) is a ``ValueError`` for any other name."""
    if not isinstance(name, str) or not name:
        raise ModelNotFoundError(f"a model name must be a non-empty string, got {name!r}; "
                                 f"give {KINDS}")
    path = Path(name).expanduser()
    if (path.exists() or name == DEMO) and revision is not None:
        raise ValueError(f"revision={revision!r} applies to Hugging Face Hub ids only, and "
                         f"{name!r} is " + ("a local path" if path.exists() else "the demo"))
    if path.exists():
        return ModelSource(path)
    if name == DEMO:
        from raypp.demo import demo_model_path

        return ModelSource(demo_model_path(cache_dir, fetch=fetch))
    hub_id = _parse_hub_id(name)
    if hub_id is None:
        raise ModelNotFoundError(f"model {name!r} not found: no such file or directory, and not "
                                 f"a Hugging Face Hub id (org/name); a model is {KINDS}")
    repo_id, filename = hub_id
    return _from_hub(name, repo_id, filename, revision, download=fetch)


def stage_checkpoint(path: str, hub: HubModel | None) -> str:
    """The checkpoint path a stage loads on this node: ``path`` where it exists here,
    else (a node that does not share the driver's disk) the Hub model fetched into this
    node's cache at the driver's commit. ``ModelNotFoundError`` for a local path missing
    here, or a Hub model this node cannot fetch."""
    if Path(path).exists():
        return path
    if hub is None:
        import socket

        raise ModelNotFoundError(
            f"model path {path!r} does not exist on node {socket.gethostname()}: every stage "
            "reads the checkpoint from the path the driver resolved; put it on a disk every "
            "node mounts at that path, or name the model by its Hugging Face Hub id so each "
            "node fetches it into its own cache")
    name = hub.repo_id + (f"/{hub.filename}" if hub.filename else "")
    return str(_from_hub(name, hub.repo_id, hub.filename, hub.commit, download=True).path)


def _parse_hub_id(name: str) -> tuple[str, str | None] | None:
    """``(repo_id, GGUF file or None)`` when ``name`` is spelled as a Hub id, else ``None``."""
    parts = name.split("/")
    if len(parts) > 2 and name.endswith(".gguf"):
        repo_id, filename = "/".join(parts[:2]), "/".join(parts[2:])
    else:
        repo_id, filename = name, None
    if not _REPO_ID.fullmatch(repo_id) or "--" in repo_id or ".." in repo_id:
        return None
    if filename is not None and any(p in ("", ".", "..") for p in filename.split("/")):
        return None
    return repo_id, filename


def _from_hub(name: str, repo_id: str, filename: str | None, revision: str | None,
              download: bool) -> ModelSource:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.utils import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    offline = bool(constants.HF_HUB_OFFLINE) or not download
    at = f" at revision {revision!r}" if revision else ""
    tried = f"model {name!r}: no local file or directory of that name, so tried the Hugging Face Hub"
    if not offline:
        logger.info("model %s: fetching %s%s from the Hugging Face Hub (cache: %s)", name,
                    filename or "the model's files", at, constants.HF_HUB_CACHE)
    try:
        folder = Path(snapshot_download(
            repo_id, revision=revision, local_files_only=offline,
            allow_patterns=[filename, "generation_config.json"] if filename else list(HF_FILES),
            ignore_patterns=None if filename else list(_HF_SKIPPED)))
    except GatedRepoError:  # before its base class, RepositoryNotFoundError
        raise ModelNotFoundError(
            f"{tried}: repo {repo_id!r} is gated: accept its terms on "
            f"https://huggingface.co/{repo_id} and give a token with access (HF_TOKEN, or "
            "huggingface-cli login)") from None
    except RepositoryNotFoundError:
        raise ModelNotFoundError(
            f"{tried}: it has no repo {repo_id!r} (or the repo is private: set HF_TOKEN to a "
            f"token with access); a model is {KINDS}") from None
    except RevisionNotFoundError:
        raise ModelNotFoundError(f"{tried}: repo {repo_id!r} has no revision {revision!r} "
                                 "(a branch, tag or commit)") from None
    except LocalEntryNotFoundError as e:
        if offline:
            raise ModelNotFoundError(
                f"{tried}: {repo_id!r}{at} is not in the Hugging Face cache "
                f"({constants.HF_HUB_CACHE}) and the Hub is offline (HF_HUB_OFFLINE=1): fetch it "
                f"once with network access (raypp fetch {name}), or point HF_HUB_CACHE at a cache "
                "that holds it") from None
        cause = e.__cause__ or e
        raise ModelNotFoundError(
            f"{tried}: the Hub could not be reached ({type(cause).__name__}: "
            f"{str(cause).splitlines()[0] if str(cause) else ''}) and {repo_id!r}{at} is not "
            "cached: check the network (or HF_ENDPOINT), or set HF_HUB_OFFLINE=1 to use the "
            "cache only") from None
    _check_snapshot(folder, tried, repo_id, filename, at, offline)
    # The cache's layout: <cache>/models--org--name/snapshots/<commit>/<files>.
    hub = HubModel(repo_id, commit=folder.name, filename=filename)
    return ModelSource(folder / filename if filename else folder, hub)


def _check_snapshot(folder: Path, tried: str, repo_id: str, filename: str | None, at: str,
                    offline: bool) -> None:
    """The snapshot holds what an engine reads (an offline cache may hold only part)."""
    where = ("the cached copy" if offline else "the repo") + f" of {repo_id!r}{at}"
    if filename is not None:
        if not (folder / filename).is_file():
            raise ModelNotFoundError(f"{tried}: {where} has no file {filename!r}")
        return
    if not (folder / "config.json").is_file():
        raise ModelNotFoundError(
            f"{tried}: {where} has no config.json, so it is no Hugging Face–format model; if "
            f"the repo holds GGUF files, name one: {repo_id}/FILE.gguf")
    if not any((folder / f).is_file() for f in ("model.safetensors",
                                                  "model.safetensors.index.json")):
        raise ModelNotFoundError(
            f"{tried}: {where} has no model.safetensors (nor its sharded index): raypp reads "
            "safetensors weights" + ("; fetch the model with network access once" if offline
                                     else ""))
