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
