"""OnlineLLM: the public API. One engine over one base model, serving many requests and many adapters."""
from __future__ import annotations

import asyncio
import gc
import json
import logging
import queue
import shutil
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Iterator

import torch

from .config import EngineConfig, LearnConfig, LoraConfig, settings_from_kwargs
from .engine.engine import Engine
from .engine.sequence import RequestOutput, SamplingParams
from .engine.warm import warm_serving
from .errors import InvalidRequestError, UnknownAdapterError
from .learn.jobs import Learner, LearnJob
from .lora.weights import AdapterWeights
from .models.decoder import load_model
from .models.loader import dark_home, resolve_model
from .store.db import Store

log = logging.getLogger(__name__)

SWITCH_INTERVAL_S = 0.0005  # the longest a thread holding the GIL keeps it from one that waits (sys.setswitchinterval)

# the serving warm-up's prompt: a chat turn of ~50 tokens with the template (several KV blocks, a few chunks' worth)
WARM_PROMPT = "Warming up: name three colours, count from one to ten in words, and say which city is France's capital."

Prompt = "str | list[dict]"  # a plain prompt (sent as one user turn) or a list of chat messages


@dataclass
class Completion:
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    adapter: tuple[str, int] | None
    token_ids: list[int]
    logprobs: list[float] | None = None


def processor_chat_template(folder: Path) -> str | None:
    """The chat template a multimodal model's processor keeps beside the tokenizer (chat_template.json, as a
    Qwen2.5-VL folder saved by its processor may have it), which AutoTokenizer does not read; None without one."""
    path = Path(folder) / "chat_template.json"
    try:
        template = json.loads(path.read_text()).get("chat_template") if path.is_file() else None
    except (OSError, ValueError, AttributeError):
        return None
    return template if isinstance(template, str) and template.strip() else None


def pick_device(device: str) -> torch.device:
    if device:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class OnlineLLM:
    """Serve a base model and its LoRA adapters ("skills").

    `OnlineLLM()` takes the embedded SmolLM2-135M-Instruct on a machine without CUDA and
    Qwen/Qwen2.5-7B-Instruct on CUDA; `model` may also be a Hugging Face id, a local folder or a .gguf file.
    Settings are the fields of EngineConfig (device, dtype, max_num_seqs, max_model_len, ...).
    `data_dir` holds the SQLite store (conversations, examples, jobs, adapter versions) and the adapter
    folders; by default one per base model under $DARK_HOME/data. `learn` overrides LearnConfig defaults.
    """

    def __init__(self, model: str | Path | None = None, *, data_dir: str | Path | None = None,
                 learn: LearnConfig | dict | None = None, **settings):
        config = settings_from_kwargs(EngineConfig, settings)
        learn_config = learn if isinstance(learn, LearnConfig) else LearnConfig(**(learn or {}))
        learn_config.validate()
        if settings:
            raise InvalidRequestError(f"unknown settings {sorted(settings)}; known: {sorted(EngineConfig.__dataclass_fields__)}")
        device = pick_device(config.device)
        dtype = getattr(torch, config.dtype) if config.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
        self.model_path = resolve_model(model, device.type)
        self.model_name = str(model) if model else self.model_path.name
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        if not self.tokenizer.chat_template:
            self.tokenizer.chat_template = processor_chat_template(self.model_path)
        if not self.tokenizer.chat_template:
            raise InvalidRequestError(f"the tokenizer of {self.model_name} has no chat template; dark needs an instruct/chat model")
        log.info("loading %s onto %s (%s)", self.model_name, device, dtype)
        self.model = load_model(self.model_path, device, dtype)
        self.engine = Engine(self.model, self.tokenizer, config, self._eos_ids())
        self.data_dir = Path(data_dir) if data_dir else dark_home() / "data" / self.model_path.name
        self.store = Store(self.data_dir / "dark.db")
        self.learner = Learner(self, self.store, self.data_dir / "adapters", learn_config)
        self.engine.adapters.loader = self._load_version
        self._restore_adapters()
        self.warm_serving_seconds: float | None = None
        if config.warm_serving if config.warm_serving is not None else device.type == "cuda":
            self._warm_serving()
        self.learner.start()
        resumed = self.learner.resume()
        if resumed:
            log.info("resuming %d learn jobs accepted before the last shutdown", len(resumed))
        # everything made so far (the imported libraries, the model, the tokenizer) lives as long as the server:
        # out of the collector's sight, a full collection no longer walks it. Measured on an H200 serving a 7B
        # model while training: a full collection stopped decoding for 307 ms. close() hands it back.
        gc.collect()
        gc.freeze()
        # a learn job's thread runs Python without pause; the engine's thread gives the GIL up while it waits for
        # the device and needs it back to start the next step. CPython hands it back only after the switch
        # interval (5 ms by default, a whole decode step): at 0.5 ms the wait is bounded by a tenth of a step
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))

    def _warm_serving(self) -> None:
        """Throwaway requests before the model serves (EngineConfig.warm_serving, dark.engine.warm); a failure is
        logged, and the first requests then pay what it would have."""
        try:
            got = warm_serving(self.engine, self.encode(WARM_PROMPT))
        except Exception:
            log.exception("the serving warm-up failed; the first requests compile and capture what they need instead")
            return
        self.warm_serving_seconds = round(got["seconds"], 3)
        log.info("serving warmed up in %.2f s (%d throwaway requests, %d decode graphs captured)",
                 got["seconds"], got["requests"], got["graphs"])

    def _load_version(self, name: str, version: int) -> AdapterWeights:
        """A version's factors from its folder (the adapter manager's loader for versions it evicted)."""
        rows = {v["version"]: v for v in self.store.list_versions(name)}
        return AdapterWeights.load(Path(rows[version]["path"]))

    def _restore_adapters(self) -> None:
        """Every stored adapter comes back at its current version (other versions load when asked for)."""
        for row in self.store.list_adapters():
            self._ensure_version(row["name"], row["current_version"], make_current=True)

    def _ensure_version(self, name: str, version: int, make_current: bool = False) -> None:
        mgr = self.engine.adapters
        if version in mgr.versions(name):
            if make_current:
                mgr.set_current(name, version)
            return
        rows = {v["version"]: v for v in self.store.list_versions(name)}
        if version not in rows:
            raise UnknownAdapterError(f"adapter {name!r} has no version {version}; versions: {sorted(rows)}")
        mgr.publish(name, version, AdapterWeights.load(Path(rows[version]["path"])), make_current=make_current,
                    stored=True)

    def _eos_ids(self) -> set[int]:
        ids = set()
        gen = self.model_path / "generation_config.json"
        if gen.is_file():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    # --- prompts ---
    def encode(self, prompt) -> list[int]:
        """Token ids of a prompt: a string becomes one user turn; a list of messages goes through the template."""
        if isinstance(prompt, str):
            messages = [{"role": "user", "content": prompt}]
        elif isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt):
            messages = prompt
            for m in messages:
                if m.get("role") not in ("system", "user", "assistant", "tool") or not isinstance(m.get("content", ""), str):
                    raise InvalidRequestError(f"a message needs a role (system, user, assistant or tool) and string content "
                                              f"(dark serves text: no images); got {m!r}")
        else:
            raise InvalidRequestError(f"a prompt is a string or a list of message dicts, not {type(prompt).__name__}")
        if not messages:
            raise InvalidRequestError("the message list is empty")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def fit_conversation(self, messages: list[dict], reply_tokens: int = 0) -> tuple[list[dict], int]:
        """The latest part of a conversation that fits the context window with room for a reply of `reply_tokens`
        (at most half the window is held for it): the oldest turns after the leading system messages are left
        out, from one user turn to the next, so what is kept starts with a user turn. Returns (messages, how many
        were left out). The last user turn and what follows it are always kept: when they alone do not fit, the
        conversation comes back whole (submitting it raises PromptTooLongError, as before)."""
        limit = self.engine.max_model_len
        room = limit - 1 - max(0, min(int(reply_tokens or 0), limit // 2))
        if len(self.encode(messages)) <= room:
            return messages, 0
        head = 0
        while head < len(messages) and messages[head].get("role") == "system":
            head += 1
        cuts = [i for i in range(head + 1, len(messages)) if messages[i].get("role") == "user"]
        fits = lambda i: len(self.encode(messages[:head] + messages[i:])) <= room  # noqa: E731
        if not cuts or not fits(cuts[-1]):
            return messages, 0
        lo, hi = 0, len(cuts) - 1  # the earliest cut that fits (a later cut keeps less, so fits too)
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if fits(cuts[mid]) else (mid + 1, hi)
        return messages[:head] + messages[cuts[lo]:], cuts[lo] - head

    def _adapter_key(self, adapter: str | None, version: int | None = None):
        if adapter is None or adapter == "":
            return None
        if not isinstance(adapter, str):
            raise InvalidRequestError(f"adapter must be a name (string), not {type(adapter).__name__}")
        return self.engine.adapters.resolve(adapter, version)

    # --- requests ---
    def submit(self, prompt, on_output, adapter: str | None = None, sampling: SamplingParams | None = None,
               adapter_version: int | None = None, **sampling_args) -> int:
        """Start one request; on_output(RequestOutput) is called from the engine thread. Returns its id."""
        params = SamplingParams.build(sampling, **sampling_args)
        return self.engine.add_request(self.encode(prompt), params, self._adapter_key(adapter, adapter_version), on_output)

    def abort(self, request_id: int) -> None:
        self.engine.abort(request_id)

    def _run_batch(self, prompts: list, adapter, sampling, sampling_args) -> list[Completion]:
        if not prompts:
            raise InvalidRequestError("the list of prompts is empty")
        params = SamplingParams.build(sampling, **sampling_args)
        key = self._adapter_key(adapter)
        encoded = [self.encode(p) for p in prompts]  # all checked before any starts
        done = [threading.Event() for _ in prompts]
        results: list[RequestOutput | None] = [None] * len(prompts)

        def collector(i):
            def on_output(out: RequestOutput):
                if out.finished:
                    results[i] = out
                    done[i].set()
            return on_output

        ids = [self.engine.add_request(ids, params, key, collector(i)) for i, ids in enumerate(encoded)]
        try:
            for ev in done:
                ev.wait()
        except BaseException:
            for rid in ids:
                self.engine.abort(rid)
            raise
        for out in results:
            if out.error is not None:
                raise out.error
        return [Completion(o.text, o.finish_reason, o.prompt_tokens, o.completion_tokens, o.adapter, o.output_ids, o.logprobs) for o in results]

    def complete(self, prompt, adapter: str | None = None, sampling: SamplingParams | None = None, **sampling_args):
        """Like generate, but returns Completion objects (text, finish_reason, token counts, adapter version)."""
        single = not (isinstance(prompt, list) and prompt and not isinstance(prompt[0], dict))
        out = self._run_batch([prompt] if single else prompt, adapter, sampling, sampling_args)
        return out[0] if single else out

    def generate(self, prompt: str | list[str], adapter: str | None = None, sampling: SamplingParams | None = None,
                 **sampling_args) -> str | list[str]:
        """Answer a prompt (or a list of prompts, run as one batch) as the assistant."""
        if isinstance(prompt, list):
            if not all(isinstance(p, str) for p in prompt):
                raise InvalidRequestError("generate takes a string or a list of strings; use chat() for messages")
            return [c.text for c in self._run_batch(prompt, adapter, sampling, sampling_args)]
        if not isinstance(prompt, str):
            raise InvalidRequestError(f"generate takes a string or a list of strings, not {type(prompt).__name__}")
        return self._run_batch([prompt], adapter, sampling, sampling_args)[0].text

    def chat(self, messages: list[dict] | list[list[dict]], adapter: str | None = None,
             sampling: SamplingParams | None = None, **sampling_args) -> str | list[str]:
        """Reply to a conversation (a list of {"role", "content"}), or to a list of conversations as one batch."""
        batch = isinstance(messages, list) and bool(messages) and isinstance(messages[0], list)
        out = self._run_batch(messages if batch else [messages], adapter, sampling, sampling_args)
        return [c.text for c in out] if batch else out[0].text

    def stream(self, prompt, adapter: str | None = None, sampling: SamplingParams | None = None,
               **sampling_args) -> Iterator[str]:
        """Yield the answer's text as it is generated. Closing the iterator early cancels the request."""
        q: queue.Queue[RequestOutput] = queue.Queue()
        rid = self.submit(prompt, q.put, adapter, sampling, **sampling_args)
        finished = False
        try:
            while True:
                out = q.get()
                if out.error is not None:
                    finished = True
                    raise out.error
                if out.delta:
                    yield out.delta
                if out.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.engine.abort(rid)

    def chat_stream(self, messages: list[dict], adapter: str | None = None, sampling: SamplingParams | None = None,
                    **sampling_args) -> Iterator[str]:
        return self.stream(messages, adapter, sampling, **sampling_args)

    # --- learning ---
    def submit_learn(self, examples: list[dict], adapter: str, kind: str = "sft", source: str = "api",
                     message_id: str | None = None, on_event=None, lora: LoraConfig | dict | None = None,
                     **learn_settings) -> LearnJob:
        """Accept examples for an adapter (created when new) and queue a job; returns at once.

        The examples and the job are on disk before this returns. on_event(dict) gets "queued", "running"
        (step, loss) and "done" (version, verified, report) or "failed" (error) events from a worker thread.
        """
        return self.learner.submit(examples, adapter, kind, source, message_id, on_event, self._lora(lora), learn_settings)

    def learn(self, examples: list[dict], adapter: str, kind: str = "sft", lora: LoraConfig | dict | None = None,
              **learn_settings) -> dict:
        """Teach an adapter these examples, until its greedy answers reproduce them (or the step cap).

        Returns the report: adapter, version, steps, losses, verified, seconds. Serving goes on meanwhile.
        """
        return self.submit_learn(examples, adapter, kind, lora=lora, **learn_settings).wait()

    def unlearn(self, examples: list[dict], adapter: str, **learn_settings) -> dict:
        """Push an adapter away from the given responses, without teaching a replacement."""
        return self.submit_learn(examples, adapter, "unlearn", **learn_settings).wait()

    def _lora(self, lora) -> LoraConfig | None:
        if lora is None or isinstance(lora, LoraConfig):
            return lora.validate(self.engine.config.max_lora_rank) if lora else None
        if not isinstance(lora, dict):
            raise InvalidRequestError("lora must be a LoraConfig or a dict with r, alpha, target_modules")
        return LoraConfig(**lora).validate(self.engine.config.max_lora_rank)

    # --- adapters ---
    def create_adapter(self, name: str, r: int = 16, alpha: float = 32.0, target_modules=None) -> dict:
        """A new, empty adapter (version 0 answers like the base model)."""
        if name in self.engine.adapters.names():
            raise InvalidRequestError(f"adapter {name!r} already exists")
        lora = LoraConfig(r, alpha, tuple(target_modules) if target_modules else LoraConfig().target_modules)
        self.learner.create_adapter(name, lora.validate(self.engine.config.max_lora_rank))
        return self.store.get_adapter(name)

    def load_adapter(self, name: str, path: str | Path) -> int:
        """Import a PEFT LoRA folder as the next version of adapter `name`; returns the version number."""
        weights = AdapterWeights.load(Path(path))
        if name not in self.engine.adapters.names():
            self.store.create_adapter(name, {"r": weights.config.r, "alpha": weights.config.alpha,
                                             "target_modules": list(weights.config.target_modules)})
        versions = [v["version"] for v in self.store.list_versions(name)]
        version = max(versions) + 1 if versions else 1
        parent = self.engine.adapters.current(name) if versions else None
        self.learner.publish(name, version, weights, parent, {"imported_from": str(path)})
        return version

    def adapters(self) -> list[dict]:
        """Every adapter with its current version and all kept versions."""
        return [{"name": a["name"], "version": a["current_version"],
                 "versions": [v["version"] for v in self.store.list_versions(a["name"])]}
                for a in sorted(self.store.list_adapters(), key=lambda a: a["name"])]

    def adapter_versions(self, name: str) -> list[dict]:
        self.engine.adapters.resolve(name)
        return self.store.list_versions(name)

    def adapter_path(self, name: str, version: int | None = None) -> Path:
        """The PEFT folder (adapter_config.json + adapter_model.safetensors) of a version (default: current)."""
        name, version = (name, version) if version is not None else self.engine.adapters.resolve(name)
        rows = {v["version"]: v for v in self.adapter_versions(name)}
        if version not in rows:
            raise UnknownAdapterError(f"adapter {name!r} has no version {version}; versions: {sorted(rows)}")
        return Path(rows[version]["path"])

    def rollback(self, name: str, version: int) -> None:
        """Serve `version` of the adapter from the next request on; later learning continues from it."""
        self.engine.adapters.resolve(name)
        self._ensure_version(name, version)
        self.store.set_current_version(name, version)
        self.engine.adapters.set_current(name, version)
        self.learner.forget_optimizer(name)

    def undo(self, name: str) -> int:
        """Go back to the version the current one was trained from; returns it."""
        current = self.engine.adapters.current(name)
        row = next(v for v in self.store.list_versions(name) if v["version"] == current)
        if row.get("parent_version") is None:
            raise InvalidRequestError(f"adapter {name!r} is at version {current}, which has nothing before it to go back to")
        self.rollback(name, row["parent_version"])
        return row["parent_version"]

    def delete_adapter(self, name: str) -> None:
        """Remove an adapter, its versions and its examples. Generations already running on it finish."""
        self.engine.adapters.remove(name)
        self.store.delete_adapter(name)
        self.learner.forget_optimizer(name)
        shutil.rmtree(self.learner.dir / name, ignore_errors=True)

    def close(self) -> None:
        self.learner.close()
        self.engine.close()
        self.store.close()
        gc.unfreeze()  # what this instance froze can be collected again once it is gone

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class AsyncOnlineLLM:
    """The same calls as coroutines and async iterators, safe to use from many tasks at once."""

    def __init__(self, model: str | Path | None = None, *, llm: OnlineLLM | None = None, **settings):
        self.llm = llm or OnlineLLM(model, **settings)

    async def _outputs(self, prompt, adapter, sampling, sampling_args) -> AsyncIterator[RequestOutput]:
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[RequestOutput] = asyncio.Queue()
        rid = self.llm.submit(prompt, lambda out: loop.call_soon_threadsafe(q.put_nowait, out), adapter, sampling,
                              **sampling_args)
        finished = False
        try:
            while True:
                out = await q.get()
                if out.finished:
                    finished = True
                if out.error is not None:
                    raise out.error
                yield out
                if out.finished:
                    return
        finally:
            if not finished:
                self.llm.abort(rid)

    async def complete(self, prompt, adapter=None, sampling=None, **sampling_args) -> Completion:
        async for out in self._outputs(prompt, adapter, sampling, sampling_args):
            if out.finished:
                return Completion(out.text, out.finish_reason, out.prompt_tokens, out.completion_tokens, out.adapter,
                                  out.output_ids, out.logprobs)

    async def generate(self, prompt, adapter=None, sampling=None, **sampling_args):
        if isinstance(prompt, list):
            return list(await asyncio.gather(*(self.generate(p, adapter, sampling, **sampling_args) for p in prompt)))
        return (await self.complete(prompt, adapter, sampling, **sampling_args)).text

    async def chat(self, messages, adapter=None, sampling=None, **sampling_args):
        if messages and isinstance(messages[0], list):
            return list(await asyncio.gather(*(self.chat(m, adapter, sampling, **sampling_args) for m in messages)))
        return (await self.complete(messages, adapter, sampling, **sampling_args)).text

    async def stream(self, prompt, adapter=None, sampling=None, **sampling_args) -> AsyncIterator[str]:
        async for out in self._outputs(prompt, adapter, sampling, sampling_args):
            if out.delta:
                yield out.delta

    def chat_stream(self, messages, adapter=None, sampling=None, **sampling_args) -> AsyncIterator[str]:
        return self.stream(messages, adapter, sampling, **sampling_args)

    def adapters(self) -> list[dict]:
        return self.llm.adapters()

    async def load_adapter(self, name: str, path) -> int:
        return await asyncio.to_thread(self.llm.load_adapter, name, path)

    def close(self) -> None:
        self.llm.close()
