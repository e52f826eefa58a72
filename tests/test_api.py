"""The public API on the embedded SmolLM2: streaming, cancellation, limits, sampling, async use."""
from __future__ import annotations

import asyncio

import pytest

from dark import AsyncOnlineLLM, InvalidRequestError, OnlineLLM, PromptTooLongError
from dark.engine.detokenizer import detokenize_step
from dark.engine.sequence import SamplingParams, Sequence


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    with OnlineLLM(max_model_len=512, data_dir=tmp_path_factory.mktemp("api-data")) as llm:
        yield llm


def test_stream_concatenates_to_generate(llm):
    prompt = "Give me three tips for learning to cook."
    assert "".join(llm.stream(prompt, max_tokens=60)) == llm.generate(prompt, max_tokens=60)
    sampled = dict(temperature=0.9, top_p=0.9, top_k=40, seed=7, max_tokens=40)
    assert "".join(llm.stream(prompt, **sampled)) == llm.generate(prompt, **sampled)


def test_chat_uses_the_conversation(llm):
    question = "What is the capital of France?"
    assert llm.chat([{"role": "user", "content": question}]) == llm.generate(question)
    messages = [{"role": "user", "content": "Let's talk about Italy."}, {"role": "assistant", "content": "Sure, Italy!"},
                {"role": "user", "content": question}]
    with_history = llm.complete(messages, max_tokens=30)
    assert with_history.prompt_tokens > llm.complete(question, max_tokens=30).prompt_tokens + 8  # the history is sent
    assert "Italy" in llm.tokenizer.decode(llm.encode(messages))
    assert "".join(llm.chat_stream(messages, max_tokens=30)) == llm.chat(messages, max_tokens=30)
    assert llm.chat([messages, [{"role": "user", "content": question}]], max_tokens=30) == [
        llm.chat(messages, max_tokens=30), llm.generate(question, max_tokens=30)]


def test_batch_of_prompts(llm):
    prompts = ["What is the capital of France?", "What is 2+2?", "Name a colour."]
    assert llm.generate(prompts, max_tokens=30) == [llm.generate(p, max_tokens=30) for p in prompts]


def test_stream_never_splits_a_character(llm):
    text = "café 日本語 🙂 naïve — 🎉"
    ids = llm.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > len(text.split()), "the text must span multi-token characters for this test to mean anything"
    seq = Sequence([0], SamplingParams(), None, lambda out: None, 10_000)
    deltas = []
    for token in ids:
        before = len(seq.text)
        seq.token_ids.append(token)
        detokenize_step(llm.tokenizer, seq)
        deltas.append(seq.text[before:])
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text


def test_stop_strings(llm):
    prompt = "What is the capital of France?"
    full = llm.generate(prompt)
    assert "Paris" in full
    out = llm.complete(prompt, stop=["Paris"])
    assert out.finish_reason == "stop" and out.text == full[:full.index("Paris")]
    assert "".join(llm.stream(prompt, stop=["Paris"])) == out.text


def test_cancel_stops_and_frees_blocks(llm):
    total = llm.engine.blocks.num_free
    stream = llm.stream("Write a long story about a dragon.", max_tokens=400, ignore_eos=True)
    got = [next(stream) for _ in range(3)]
    stream.close()  # the consumer walks away: the request is aborted
    assert all(got)
    finished = []
    rid = llm.submit("Count from one to a thousand.", finished.append, max_tokens=400, ignore_eos=True)
    llm.abort(rid)
    import time
    deadline = time.time() + 120
    while (not finished or not finished[-1].finished or llm.engine.scheduler.has_work()) and time.time() < deadline:
        time.sleep(0.01)
    assert finished[-1].finished and finished[-1].finish_reason == "abort"
    assert finished[-1].completion_tokens < 400
    assert llm.engine.blocks.num_free == total


def test_prefix_cache_reuses_blocks(llm):
    prompt = "Summarise the plot of Hamlet in two sentences. " * 3
    first = llm.generate(prompt, max_tokens=20)
    before = llm.engine.blocks.cached_tokens
    assert llm.generate(prompt, max_tokens=20) == first
    assert llm.engine.blocks.cached_tokens - before >= 32


def test_seed_is_reproducible(llm):
    args = dict(temperature=1.0, seed=123, max_tokens=30)
    a, b = llm.generate("Invent a name for a cat.", **args), llm.generate("Invent a name for a cat.", **args)
    assert a == b


def test_over_long_prompt(llm):
    with pytest.raises(PromptTooLongError, match=r"prompt has \d+ tokens but the context limit is 512"):
        llm.generate("word " * 600)


@pytest.mark.parametrize("args, match", [
    (dict(temperature=-1), "temperature must be a number >= 0"),
    (dict(top_p=0), r"top_p must be in \(0, 1\]"),
    (dict(top_k=-2), "top_k must be an integer >= 0"),
    (dict(max_tokens=0), "max_tokens must be a positive integer"),
    (dict(stop=[""]), "stop must be a list of at most 16 non-empty strings"),
    (dict(seed="x"), "seed must be an integer"),
    (dict(temprature=0.5), r"unknown sampling arguments \['temprature'\]"),
])
def test_invalid_sampling(llm, args, match):
    with pytest.raises(InvalidRequestError, match=match):
        llm.generate("hi", **args)


def test_invalid_prompts(llm):
    with pytest.raises(InvalidRequestError, match="generate takes a string or a list of strings"):
        llm.generate(42)
    with pytest.raises(InvalidRequestError, match="needs a role"):
        llm.chat([{"role": "robot", "content": "hi"}])
    with pytest.raises(InvalidRequestError, match="unknown settings"):
        OnlineLLM(max_num_sequences=4)


def test_async_many_tasks(llm):
    allm = AsyncOnlineLLM(llm=llm)
    prompts = ["What is the capital of France?", "What is 3+4?", "Name an animal.", "Say hi."]

    async def main():
        texts = await asyncio.gather(*(allm.generate(p, max_tokens=25) for p in prompts))
        streamed = await asyncio.gather(*(collect(allm.stream(p, max_tokens=25)) for p in prompts))
        return texts, streamed

    async def collect(it):
        return "".join([d async for d in it])

    texts, streamed = asyncio.run(main())
    assert texts == streamed == [llm.generate(p, max_tokens=25) for p in prompts]


def test_the_model_is_out_of_the_collectors_sight_while_it_serves(llm):
    """Objects that live as long as the server (libraries, model, tokenizer) are frozen out of the garbage
    collector once the model is loaded, so a full collection stays short while decoding; the model's own
    parameters are among them."""
    import gc

    assert gc.get_freeze_count() > 10_000
    frozen = {id(o) for o in gc.get_objects(generation=None)}  # tracked objects not frozen
    assert not any(id(p) in frozen for p in llm.model.parameters())


def test_a_long_conversation_keeps_its_latest_turns(llm):
    """fit_conversation: the system prompt and the latest whole turns that fit the window (512 tokens here) with
    room for the reply; a conversation that fits, or whose last turn alone does not, comes back unchanged."""
    system = {"role": "system", "content": "You are terse."}
    turns = []
    for i in range(12):
        turns += [{"role": "user", "content": f"Fact {i}: " + "the quick brown fox jumps over the lazy dog " * 6},
                  {"role": "assistant", "content": "Noted. " * 10}]
    messages = [system] + turns + [{"role": "user", "content": "What is the capital of France?"}]
    room = 512 - 1 - 64
    assert len(llm.encode(messages)) > room
    kept, dropped = llm.fit_conversation(messages, reply_tokens=64)
    assert dropped > 0 and dropped % 2 == 0 and kept == [system] + messages[1 + dropped:]
    assert len(llm.encode(kept)) <= room < len(llm.encode([system] + messages[1 + dropped - 2:]))  # the earliest cut
    assert llm.complete(kept, max_tokens=8).prompt_tokens == len(llm.encode(kept))
    # the reply's room is at most half the window
    assert llm.fit_conversation(messages, reply_tokens=10_000)[1] >= dropped
    assert len(llm.encode(llm.fit_conversation(messages, reply_tokens=10_000)[0])) <= 512 - 1 - 256
    assert llm.fit_conversation(messages[-3:], 64) == (messages[-3:], 0)
    huge = [{"role": "user", "content": "word " * 2000}]
    assert llm.fit_conversation(turns[:2] + huge, 64) == (turns[:2] + huge, 0)
    with pytest.raises(PromptTooLongError):
        llm.chat(turns[:2] + huge, max_tokens=8)
