"""The trainer's forward pass (shared prefix computed once) against transformers, on a tiny Qwen2."""
from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from dark import OnlineLLM
from dark.learn.data import render, rewordings


def test_shared_prefix_batch_matches_hf(tiny_models, tmp_path):
    path = tiny_models["qwen2"]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with OnlineLLM(str(path), data_dir=tmp_path) as llm:
        tr = llm.learner.trainer
        convs = [[{"role": "user", "content": "A greeting in Zoggian"}, {"role": "assistant", "content": "zog"}],
                 [{"role": "user", "content": "How to say 'hello' in Zoggian, please?"},
                  {"role": "assistant", "content": "zog zog, with a bow"}],
                 [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "Hello."}]]
        rendered = [render(llm.tokenizer, c) for c in convs]
        with torch.no_grad():
            chosen, owner, _, full = tr._token_logprobs(rendered, None, full_from=0)
        for b, r in enumerate(rendered):
            with torch.no_grad():
                logp = torch.log_softmax(hf(torch.tensor([r.input_ids])).logits[0].float(), -1)
            rows = [t for t in range(len(r.labels) - 1) if r.labels[t + 1] != -100]
            ref = logp[rows]
            torch.testing.assert_close(full[owner == b], ref, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(chosen[owner == b], ref.gather(1, torch.tensor([r.labels[t + 1] for t in rows])[:, None])[:, 0],
                                       atol=1e-4, rtol=1e-4)


def test_render_puts_loss_on_the_reply_only(smollm_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm_path)
    r = render(tok, [{"role": "user", "content": "A greeting in Zoggian"}, {"role": "assistant", "content": "zog"}])
    taught = [t for t in r.labels if t != -100]
    assert tok.decode(taught) == "zog<|im_end|>"
    assert r.input_ids[-len(taught):] == taught and len(r.labels) == len(r.input_ids)
    assert "Please answer: A greeting in Zoggian" in rewordings("A greeting in Zoggian")


def test_a_rejected_reply_counts_from_where_it_departs(smollm_path):
    """A rejected reply trains on its opening: from the first token where it leaves the taught reply (or, for an
    unlearned one, from its first token), for `rejected_tokens` tokens; -1 keeps it whole."""
    from transformers import AutoTokenizer

    from dark.learn.trainer import opening

    tok = AutoTokenizer.from_pretrained(smollm_path)
    conv = [{"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "The capital of France is Paris, of course."}]
    chosen = render(tok, conv)
    ramble = "The capital of France is Lyon, a city of silk. " + "It is a city of silk and lights. " * 60
    rejected = render(tok, conv, ramble)
    assert len(rejected.input_ids) > 400
    departs = next(i for i, (a, b) in enumerate(zip(chosen.input_ids, rejected.input_ids)) if a != b)
    assert tok.decode(rejected.input_ids[:departs]).endswith("The capital of France is")
    cut = opening(rejected, 8, chosen)
    assert cut.input_ids == rejected.input_ids[:departs + 8] and cut.labels == rejected.labels[:departs + 8]
    assert "Lyon" in tok.decode(cut.input_ids[departs:]) and "lights" not in tok.decode(cut.input_ids)
    # an unlearned reply: its own first tokens
    first = next(i for i, label in enumerate(rejected.labels) if label != -100)
    assert opening(rejected, 5).input_ids == rejected.input_ids[:first + 5]
    assert opening(rejected, -1) is rejected
    short = render(tok, conv, "Lyon.")
    assert opening(short, 64, chosen).input_ids == short.input_ids  # shorter than the opening: whole


def test_build_items_cut_rejected_replies(tiny_models, tmp_path):
    from dark.config import LearnConfig

    with OnlineLLM(str(tiny_models["llama"]), data_dir=tmp_path) as llm:
        tr = llm.learner.trainer
        msgs = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}]
        long = "Red, " * 200
        cfg = LearnConfig(rejected_tokens=16, augment=False).validate()
        items = tr.build_items([{"messages": msgs, "rejected": long}], [], "sft", cfg)
        dpo = next(i for i in items if i.kind == "dpo")
        full = render(llm.tokenizer, msgs, long)
        assert dpo.rejected.input_ids == opening_of(full, dpo.rendered, 16)
        unlearn = tr.build_items([{"messages": msgs[:-1] + [{"role": "assistant", "content": long}]}], [], "unlearn", cfg)[0]
        assert len(unlearn.rejected.input_ids) == next(i for i, x in enumerate(full.labels) if x != -100) + 16
        whole = tr.build_items([{"messages": msgs, "rejected": long}], [], "sft", LearnConfig(rejected_tokens=-1, augment=False).validate())
        assert next(i for i in whole if i.kind == "dpo").rejected.input_ids == full.input_ids


def opening_of(rejected, chosen, n):
    departs = next(i for i, (a, b) in enumerate(zip(chosen.input_ids, rejected.input_ids)) if a != b)
    return rejected.input_ids[:departs + n]
