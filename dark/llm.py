"""OnlineLLM: the public API. One engine over one base model, serving many requests and many adapters."""
from __future__ import annotations

import asyncio
import json
import logging
import queue
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Iterator

import torch

from .config import EngineConfig, settings_from_kwargs
from .engine.engine import Engine
from .engine.sequence import RequestOutput, SamplingParams
from .errors import InvalidRequestError
from .lora.weights import AdapterWeights
from .models.decoder import load_model
from .models.loader import resolve_model

log = logging.getLogger(__name__)

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


def pick_device(device: str) -> torch.device:
    if device:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class OnlineLLM:
    """Serve a base model and its LoRA adapters ("skills").

    `OnlineLLM()` takes the embedded SmolLM2-135M-Instruct on a machine without CUDA and
    Qwen/Qwen2.5-7B-Instruct on CUDA; `model` may also be a Hugging Face id, a local folder or a .gguf file.
    Settings are the fields of EngineConfig (device, dtype, max_num_seqs, max_model_len, ...).
    """

    def __init__(self, model: str | Path | None = None, **settings):
        config = settings_from_kwargs(EngineConfig, settings)
        if settings:
            raise InvalidRequestError(f"unknown settings {sorted(settings)}; known: {sorted(EngineConfig.__dataclass_fields__)}")
        device = pick_device(config.device)
        dtype = getattr(torch, config.dtype) if config.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
        self.model_path = resolve_model(model, device.type)
        self.model_name = str(model) if model else self.model_path.name
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        if not self.tokenizer.chat_template:
            raise InvalidRequestError(f"the tokenizer of {self.model_name} has no chat template; dark needs an instruct/chat model")
        log.info("loading %s onto %s (%s)", self.model_name, device, dtype)
        self.model = load_model(self.model_path, device, dtype)
        self.engine = Engine(self.model, self.tokenizer, config, self._eos_ids())

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
                    raise InvalidRequestError(f"a message needs a role (system, user, assistant or tool) and string content; got {m!r}")
        else:
            raise InvalidRequestError(f"a prompt is a string or a list of message dicts, not {type(prompt).__name__}")
        if not messages:
            raise InvalidRequestError("the message list is empty")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

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

    # --- adapters ---
    def load_adapter(self, name: str, path: str | Path) -> int:
        """Load a PEFT LoRA folder as a new version of adapter `name`; returns the version number."""
        weights = AdapterWeights.load(Path(path))
        versions = self.engine.adapters.versions(name)
        version = (max(versions) + 1) if versions else 1
        self.engine.adapters.publish(name, version, weights)
        return version

    def adapters(self) -> list[dict]:
        """Every adapter with its current version and all kept versions."""
        mgr = self.engine.adapters
        return [{"name": n, "version": mgr.current(n), "versions": mgr.versions(n)} for n in mgr.names()]

    def close(self) -> None:
        self.engine.close()

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
