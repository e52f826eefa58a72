"""The engine: one thread that steps the scheduler and the model while requests come and go.

Requests, aborts and calls that must happen between steps arrive through an inbox, so the engine's state
is touched by its own thread only. Outputs leave through each request's callback.
"""
from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections import deque
from typing import Callable

import torch

from ..config import EngineConfig
from ..errors import InvalidRequestError, PromptTooLongError
from ..lora.manager import AdapterManager
from ..lora.slots import AdapterSlots
from ..models.decoder import CausalLM
from .attention import KVCache
from .block_manager import BlockManager
from .detokenizer import detokenize_step, find_stop, releasable
from .runner import ModelRunner
from .scheduler import Scheduler
from .sequence import RequestOutput, SamplingParams, Sequence

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, model: CausalLM, tokenizer, config: EngineConfig, eos_token_ids: set[int]):
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.eos_token_ids = eos_token_ids
        mc = model.config
        param = model.model.embed_tokens.weight
        self.device, self.dtype = param.device, param.dtype
        self.max_model_len = config.max_model_len or min(mc.max_position_embeddings, 32768)
        num_blocks = config.num_kv_blocks or self._blocks_that_fit(mc)
        self.cache = KVCache(mc.num_layers, num_blocks, config.block_size, mc.num_kv_heads, mc.head_dim,
                             self.dtype, self.device)
        self.adapters = AdapterManager(AdapterSlots(mc, config.max_adapter_slots, config.max_lora_rank,
                                                    self.device, self.dtype))
        slots = self.adapters.slots
        if slots.use_kernels and not slots.extend_weights(model):
            # every slot's A rows beside the projections' weights (a decode step's codes out of its GEMMs) only
            # while reading them all costs less than the shrink launches
            log.info("%d adapter slots x max_lora_rank %d: steps of several tokens keep a shrink launch per "
                     "projection", slots.num_slots, slots.max_rank)
        self.adapters.on_loaded = self._poke  # a version reached the device: a waiting request can take its slot
        self.blocks = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, self.adapters, config.max_num_seqs, config.max_num_batched_tokens)
        self.runner = ModelRunner(model, self.cache, self.adapters.slots)
        self._inbox: deque = deque()
        self._wake = threading.Condition()
        self._closed = False
        self._by_id: dict[int, Sequence] = {}
        # serving outranks training: the GPU picks this stream's kernels first when both have work queued
        self.stream = torch.cuda.Stream(self.device, priority=-1) if self.device.type == "cuda" else None
        # (stream, active): while active() (a train() call runs), steps go to that stream, a partition of the SMs
        # that training stays off (dark.engine.green); else to self.stream, every SM
        self._partition: tuple[torch.cuda.Stream, Callable[[], bool]] | None = None
        self._thread = threading.Thread(target=self._loop, name="dark-engine", daemon=True)
        self._thread.start()

    def _blocks_that_fit(self, mc) -> int:
        per_block = KVCache.bytes_per_block(mc.num_layers, self.config.block_size, mc.num_kv_heads, mc.head_dim, self.dtype)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return max(64, int(free * self.config.kv_cache_memory_fraction) // per_block)
        # on the CPU: room for a few full-length contexts, at most 2 GiB
        return max(64, min(2 * 2**30 // per_block, 8 * self.max_model_len // self.config.block_size))

    # --- any thread ---
    def add_request(self, prompt_ids: list[int], params: SamplingParams, adapter: tuple[str, int] | None,
                    on_output: Callable[[RequestOutput], None]) -> int:
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty")
        n = len(prompt_ids)
        if n >= self.max_model_len:
            raise PromptTooLongError(f"the prompt has {n} tokens but the context limit is {self.max_model_len}; "
                                     f"shorten the prompt to at most {self.max_model_len - 1} tokens")
        if self.blocks.blocks_needed(n + 1) > self.cache.num_blocks:
            raise PromptTooLongError(f"the prompt has {n} tokens but the KV cache holds "
                                     f"{self.cache.num_blocks * self.cache.block_size}; shorten the prompt")
        seq = Sequence(prompt_ids, params, adapter, on_output, self.max_model_len)
        self._post(("add", seq))
        return seq.id

    def abort(self, request_id: int) -> None:
        self._post(("abort", request_id))

    def call_between_steps(self, fn: Callable) -> concurrent.futures.Future:
        """Run fn on the engine thread between two steps (for changes that must not land mid-step)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._post(("call", (fn, fut)))
        return fut

    def _poke(self) -> None:
        with self._wake:
            self._wake.notify()

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join(timeout=30)
        self.adapters.close()

    def _post(self, item) -> None:
        with self._wake:
            if self._closed:
                raise RuntimeError("the engine is closed")
            self._inbox.append(item)
            self._wake.notify()

    # --- engine thread ---
    def _loop(self) -> None:
        if self.stream is not None:
            torch.cuda.set_stream(self.stream)
        while True:
            with self._wake:
                while not self._inbox and not self.scheduler.has_work() and not self._closed:
                    self._wake.wait()
                if self._closed:
                    break
                items = list(self._inbox)
                self._inbox.clear()
            for kind, payload in items:
                self._handle(kind, payload)
            if self.scheduler.has_work():
                self._step()
        for seq in list(self._by_id.values()):
            self._finish(seq, "abort")

    def _handle(self, kind: str, payload) -> None:
        if kind == "add":
            self._by_id[payload.id] = payload
            self.scheduler.add(payload)
        elif kind == "abort":
            seq = self._by_id.get(payload)
            if seq is not None:
                self._finish(seq, "abort")
        elif kind == "call":
            fn, fut = payload
            try:
                fut.set_result(fn())
            except BaseException as e:  # handed to the caller, who decides
                fut.set_exception(e)

    def serve_in_partition(self, stream: torch.cuda.Stream | None, active: Callable[[], bool] = lambda: True,
                           sms: int | None = None) -> None:
        """Run steps on `stream` (a partition of the SMs, dark.engine.green) while active() holds, so that their
        kernels never wait for an SM a training step holds; on the engine's own stream (every SM) otherwise and
        when `stream` is None. sms: the partition's SMs, which kernels sizing their grids by SMs then plan for
        (dark.kernels.sm_budget; None: the device's count)."""
        self._partition = None if stream is None else (stream, active)
        self.runner.partition = stream
        self.runner.partition_sms = sms if stream is not None else None

    def _pick_stream(self) -> None:
        part = self._partition
        want = part[0] if part is not None and part[1]() else self.stream
        now = torch.cuda.current_stream(self.device)
        if want != now:  # the new stream's work follows what the old one has queued (a step launched ahead)
            want.wait_stream(now)
            torch.cuda.set_stream(want)

    def _step(self) -> None:
        batch = self.scheduler.schedule()
        while self.scheduler.failed:
            seq, error = self.scheduler.failed.pop()
            log.warning("request %d could not start: %s", seq.id, error)
            self._finish(seq, "error", error=error)
        if not batch:
            with self._wake:  # waiting on adapter slots or cache blocks held by others: nap until news
                self._wake.wait(timeout=0.005)
            return
        if self.stream is not None:
            self._pick_stream()
        try:
            # nothing waiting to join: the next step is likely these sequences one token on (the runner may
            # launch it before this one's tokens are back)
            results = self.runner.run(batch, ahead=not self._inbox and not self.scheduler.waiting)
        except Exception as e:
            log.exception("engine step failed; failing its %d requests", len(batch))
            for seq, _ in batch:
                self._finish(seq, "error", error=e)
            return
        for seq, n in batch:
            seq.num_computed += n
            self.blocks.commit(seq)
            if seq.id in results:
                try:
                    self._append(seq, *results[seq.id])
                except Exception as e:  # one request's text handling must not take the engine down
                    log.exception("request %d failed after sampling", seq.id)
                    self._finish(seq, "error", error=e)

    def _append(self, seq: Sequence, token: int, logprob: float | None) -> None:
        seq.token_ids.append(token)
        if logprob is not None:
            seq.logprobs.append(logprob)
        if token in self.eos_token_ids and not seq.params.ignore_eos:
            return self._finish(seq, "stop")
        searched_from = len(seq.text)
        detokenize_step(self.tokenizer, seq)
        at = find_stop(seq, searched_from) if seq.params.stop else -1
        if at >= 0:
            seq.text = seq.text[:at]
            return self._finish(seq, "stop", flush=False)
        if len(seq) >= seq.max_len:
            return self._finish(seq, "length")
        upto = releasable(seq)
        if upto > seq.emitted:
            delta, seq.emitted = seq.text[seq.emitted:upto], upto
            self._emit(seq, RequestOutput(seq.id, delta, [token], logprobs=[logprob] if logprob is not None else None))

    def _finish(self, seq: Sequence, reason: str, flush: bool = True, error: BaseException | None = None) -> None:
        if seq.id not in self._by_id:
            return
        del self._by_id[seq.id]
        self.scheduler.finish(seq)
        if flush and reason in ("stop", "length"):
            detokenize_step(self.tokenizer, seq, final=True)
        seq.finish_reason = reason
        delta = seq.text[seq.emitted:]
        seq.emitted = len(seq.text)
        self._emit(seq, RequestOutput(seq.id, delta, [], True, reason, seq.text, seq.num_prompt_tokens,
                                      seq.num_completion_tokens, seq.adapter, error,
                                      seq.logprobs if seq.params.logprobs else None, seq.output_ids))

    def _emit(self, seq: Sequence, out: RequestOutput) -> None:
        try:
            seq.on_output(out)
        except Exception:
            log.exception("output callback of request %d failed", seq.id)
