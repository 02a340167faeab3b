"""Where a run's weights come from, checked before anything is cached or written, and load errors explained.

Every piece of weights a run loads (the denoiser, the VAE, each text encoder and tokenizer, the scheduler config,
the pipeline's ``model_index.json``, the preview decoder, the CLIP scorer) is a :class:`WeightSource`: the config
field that names it, a Hugging Face repo id, a local folder or a single file, and the subfolder inside it.
:func:`check_weight_sources` (run by the trainer's preflight through ``ModelAdapter.check_weights``) proves each one
can be loaded without loading it:

- a local folder must hold the subfolder and its ``config.json`` (or the files named), a single file must exist;
- a Hub repo is listed (``HfApi.model_info``), every subfolder and file the loaders will read must be in it, the
  small files (configs, tokenizers) are fetched, and the weights not yet in the Hugging Face cache must fit on its
  disk. With ``HF_HUB_OFFLINE=1``, or when the Hub cannot be reached, the cached copy is checked instead.

Any failure (no network, gated repo, missing or refused token, unknown repo or revision, wrong subfolder, disk
full) becomes one :class:`WeightLoadError` naming the field, the id or path, and the fix (``HF_TOKEN``,
``HF_HUB_OFFLINE``, a local path). :func:`explained` does the same for errors raised while the weights load.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import shutil
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from simpletuner.config.train import is_local

log = logging.getLogger("simpletuner.models")

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf")
_SINGLE_FILE_SUFFIXES = (".safetensors", ".sft", ".ckpt", ".gguf")
_VARIANTS = ("fp16", "bf16", "fp32", "fp8", "int8")


class WeightLoadError(ValueError):
    """Weights named in the config cannot be loaded; the message names the field, the id or path, and the fix."""


@dataclass(frozen=True)
class WeightSource:
    """One piece of weights a run loads.

    ``field`` is the config key that names ``path`` (a Hub repo id, a local folder or a single file); ``folder`` the
    subfolder the loader reads (None: the path itself); ``need`` the files in it the loader opens first (empty: any
    file, as for tokenizers); ``weights`` whether the folder also holds weight files; ``subfolder_field`` the key that
    picks ``folder`` when the user can; ``alternative`` one more way out, for the error message.
    """

    field: str
    path: str
    folder: str | None = None
    need: tuple[str, ...] = ("config.json",)
    weights: bool = True
    what: str = "weights"
    revision: str | None = None
    subfolder_field: str | None = None
    alternative: str | None = None

    @property
    def location(self) -> str:
        return f"{self.path}/{self.folder}" if self.folder else self.path

    @property
    def is_single_file(self) -> bool:
        return self.folder is None and str(self.path).endswith(_SINGLE_FILE_SUFFIXES)


def _fix(source: WeightSource) -> str:
    extra = f", or {source.alternative}" if source.alternative else ""
    return f"set {source.field} to a local folder that holds it{extra}"


# ---- explaining errors ------------------------------------------------------------------------------------------
def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _cache_dir() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.is_offline_mode())


def _network_message(source: WeightSource, reason: str) -> str:
    return (f"{source.field}: cannot reach the Hugging Face Hub to fetch {source.path!r} ({reason}) and it is not in "
            f"the local cache ({_cache_dir()}). Check the network or proxy (HF_ENDPOINT), set HF_HUB_OFFLINE=1 to use "
            f"a copy downloaded earlier, or {_fix(source)}")


def _offline_message(source: WeightSource) -> str:
    return (f"{source.field}: {source.path!r} is not in the local Hugging Face cache ({_cache_dir()}) and "
            "HF_HUB_OFFLINE is set, so it cannot be downloaded. Download it where there is network "
            f"(`hf download {source.path}`) into this cache (HF_HOME), unset HF_HUB_OFFLINE, or {_fix(source)}")


def _transport_errors() -> tuple[type[BaseException], ...]:
    """Connection failures as the Hub client raises them (its HTTP library is httpx, or httpx2 in newer releases)."""
    import importlib

    found: list[type[BaseException]] = [ConnectionError]
    for name in ("httpx", "httpx2"):
        try:
            found.append(importlib.import_module(name).TransportError)
        except (ImportError, AttributeError):
            pass
    return tuple(found)


def explain(exc: BaseException, source: WeightSource) -> WeightLoadError | None:
    """A :class:`WeightLoadError` saying what went wrong loading ``source`` and how to fix it, or None when
    ``exc`` is not a failure to reach, access or store weights (a bug, not the user's setup)."""
    from huggingface_hub import errors as hub

    transport = _transport_errors()

    for err in _chain(exc):
        if isinstance(err, WeightLoadError):
            return err
        if isinstance(err, hub.GatedRepoError):
            from huggingface_hub import get_token

            if get_token():
                return WeightLoadError(
                    f"{source.field}: {source.path!r} is a gated repository and the Hugging Face token in use "
                    f"(HF_TOKEN or `hf auth login`) has not been granted access: accept its licence on "
                    f"https://huggingface.co/{source.path} with that account, or {_fix(source)}")
            return WeightLoadError(
                f"{source.field}: {source.path!r} is a gated repository and no Hugging Face token is set: accept its "
                f"licence on https://huggingface.co/{source.path}, then set HF_TOKEN (or run `hf auth login`), "
                f"or {_fix(source)}")
        if isinstance(err, hub.RevisionNotFoundError):
            return WeightLoadError(f"revision: {source.revision!r} does not exist in {source.path!r} (named by "
                                   f"{source.field}); use a branch, tag or commit of that repository, or leave "
                                   "revision empty for main")
        if isinstance(err, hub.RepositoryNotFoundError):
            token = "" if _has_token() else "; a private repository needs HF_TOKEN (or `hf auth login`)"
            return WeightLoadError(f"{source.field}: {source.path!r} is not a repository on the Hugging Face Hub"
                                   f"{token}. Check the id, or {_fix(source)}")
        if isinstance(err, hub.LocalEntryNotFoundError) or isinstance(err, hub.OfflineModeIsEnabled):
            if _offline():
                return WeightLoadError(_offline_message(source))
            cause = next((c for c in _chain(err) if isinstance(c, transport) and c is not err), None)
            return WeightLoadError(_network_message(source, _reason(cause) if cause else "not reachable"))
        if isinstance(err, hub.EntryNotFoundError):
            return WeightLoadError(_missing_message(source, []))
        if isinstance(err, hub.HfHubHTTPError) and getattr(err.response, "status_code", None) == 401:
            return WeightLoadError(
                f"{source.field}: the Hugging Face Hub refused the token for {source.path!r} (401): set a valid "
                f"HF_TOKEN (or run `hf auth login`), or {_fix(source)}")
        if isinstance(err, transport):
            if _offline():
                return WeightLoadError(_offline_message(source))
            return WeightLoadError(_network_message(source, _reason(err)))
        if isinstance(err, OSError) and err.errno == errno.ENOSPC:
            where = _cache_dir() if not is_local(source.path) else source.path
            return WeightLoadError(
                f"{source.field}: no space left on the device while storing {source.path!r} ({where}). Free "
                f"space, point HF_HOME at a larger disk, or {_fix(source)}")
    if is_local(source.path) and isinstance(exc, OSError):
        return WeightLoadError(f"{source.field}: cannot load the {source.what} from {source.location!r}: {exc}")
    return None


def _reason(err: BaseException) -> str:
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _has_token() -> bool:
    from huggingface_hub import get_token

    return bool(get_token())


def _missing_message(source: WeightSource, folders: list[str]) -> str:
    wanted = f"{source.folder}/" if source.folder else "its top level"
    files = f" ({', '.join(source.need)})" if source.need else ""
    has = f"; its folders with a config.json: {', '.join(folders)}" if folders else ""
    if source.subfolder_field:
        fix = (f"set {source.subfolder_field} to the folder that holds the {source.what} ('none' for the "
               "top level)")
    else:
        fix = f"check that {source.field} names a model in the diffusers layout"
    return (f"{source.field}: {source.path!r} has no {source.what} in {wanted}{files}{has}. "
            f"{fix}, or {_fix(source)}")


@contextlib.contextmanager
def explained(source: WeightSource) -> Iterator[None]:
    """Turn a failure to fetch or read ``source``'s weights into a :class:`WeightLoadError` (others pass)."""
    try:
        yield
    except WeightLoadError:
        raise
    except Exception as exc:
        error = explain(exc, source)
        if error is None:
            raise
        raise error from exc


# ---- checking before the run -----------------------------------------------------------------------------------
def check_weight_sources(sources: Iterable[WeightSource]) -> None:
    """Prove every source can be loaded (see the module docstring); WeightLoadError listing the problems if not."""
    sources = list(dict.fromkeys(sources))
    problems: list[str] = []
    hub_groups: dict[tuple[str, str | None], list[WeightSource]] = {}
    for source in sources:
        if is_local(source.path):
            problems.extend(_check_local(source, Path(source.path).expanduser()))
        else:
            hub_groups.setdefault((source.path, source.revision), []).append(source)
    for (repo, revision), group in hub_groups.items():
        try:
            _check_hub(repo, revision, group)
        except WeightLoadError as exc:
            problems.append(str(exc))
    if problems:
        raise WeightLoadError("\n".join(dict.fromkeys(problems)))


def _check_local(source: WeightSource, root: Path) -> list[str]:
    shown = source.location
    if source.is_single_file:
        if not root.is_file():
            return [f"{source.field}: file {source.path!r} does not exist"]
        return []
    if not root.exists():
        return [f"{source.field}: folder {source.path!r} does not exist (and it is not a Hugging Face repo id, "
                "which is written owner/name)"]
    folder = root / source.folder if source.folder else root
    if not folder.is_dir():
        present = sorted(p.parent.name for p in root.glob("*/config.json"))
        return [_missing_message(source, present)]
    missing = [name for name in source.need if not (folder / name).is_file()]
    empty = not source.need and next(folder.iterdir(), None) is None
    if missing or empty:
        return [f"{source.field}: {shown!r} has no {', '.join(missing) or 'files'} (the {source.what})"]
    if source.weights and not any(p.name.endswith(_WEIGHT_SUFFIXES) for p in folder.iterdir()):
        return [f"{source.field}: {shown!r} holds no weight files ({', '.join(_WEIGHT_SUFFIXES)}) for the "
                f"{source.what}"]
    return []


def _check_hub(repo: str, revision: str | None, sources: list[WeightSource]) -> None:
    from huggingface_hub import HfApi, hf_hub_download, snapshot_download
    from huggingface_hub import errors as hub

    first = sources[0]
    try:
        info = HfApi().model_info(repo, revision=revision, files_metadata=True)
    except Exception as exc:
        error = explain(exc, first)
        if error is None:
            raise
        unreachable = any(isinstance(e, (hub.OfflineModeIsEnabled, ConnectionError)) or _is_transport(e)
                          for e in _chain(exc))
        if not unreachable:
            raise error from exc
        try:  # no Hub: a copy downloaded earlier will do
            snapshot = Path(snapshot_download(repo, revision=revision, local_files_only=True))
        except Exception:
            raise error from exc
        problems = [p for s in sources for p in _check_local(s, snapshot)]
        if problems:
            raise WeightLoadError(f"{first.field}: the cached copy of {repo!r} ({snapshot}) is incomplete and the "
                                  f"Hub cannot be reached: " + "; ".join(problems)) from exc
        log.info("%s: the Hub is not reachable; using the cached copy of %s", first.field, repo)
        return

    files = {s.rfilename: (s.size or 0) for s in (info.siblings or [])}
    folders = sorted({name.rsplit("/", 1)[0] for name in files if name.endswith("/config.json")})
    fetch: list[tuple[WeightSource, str]] = []
    weight_files: list[str] = []
    problems = []
    for source in sources:
        prefix = f"{source.folder}/" if source.folder else ""
        inside = [n for n in files if n.startswith(prefix) and "/" not in n[len(prefix):]]
        missing = [n for n in source.need if prefix + n not in files]
        if missing or not inside:
            problems.append(_missing_message(source, folders))
            continue
        fetch += [(source, prefix + n) for n in (source.need or [n[len(prefix):] for n in inside])]
        if source.weights:
            weight_files += _weights_to_load(inside, source)
    if problems:
        raise WeightLoadError("\n".join(problems))

    _check_space(repo, info.sha, {name: files[name] for name in weight_files}, first)
    for source, name in fetch:  # small files: this is where a gated repo or a refused token shows
        with explained(source):
            hf_hub_download(repo, name, revision=info.sha)


def _is_transport(err: BaseException) -> bool:
    return isinstance(err, _transport_errors())


def _weights_to_load(names: list[str], source: WeightSource) -> list[str]:
    """The weight files of one folder the loaders read: safetensors over pickles, the variant asked for."""
    weights = [n for n in names if n.endswith(_WEIGHT_SUFFIXES)]
    safe = [n for n in weights if n.endswith(".safetensors")]
    weights = safe or weights

    def variant(name: str) -> str | None:
        parts = Path(name).name.split(".")
        return next((p for p in parts[1:-1] if p in _VARIANTS), None)

    plain = [n for n in weights if variant(n) is None]
    return plain or weights


def _check_space(repo: str, sha: str | None, weights: dict[str, int], source: WeightSource) -> None:
    from huggingface_hub import try_to_load_from_cache

    needed = sum(size for name, size in weights.items()
                 if not isinstance(try_to_load_from_cache(repo, name, revision=sha), str))
    if not needed:
        return
    where = Path(_cache_dir())
    probe = where
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if needed > free:
        raise WeightLoadError(
            f"{source.field}: {repo!r} needs {needed / 1e9:.1f} GB more in the Hugging Face cache ({where}), and "
            f"that disk has {free / 1e9:.1f} GB free. Free space, point HF_HOME at a larger disk, or {_fix(source)}")
