from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tailrace import LLM, SamplingParams
from tailrace.engine.model_runner import ModelRunner

PROMPTS = ["The list type", "Return a new", "json.dumps", "If the file does not exist,",
           "<|im_start|>user\nWhat does os.path.join do?<|im_end|>\n<|im_start|>assistant\n"]


def hf_greedy(path: str, prompts: list[str], max_new_tokens: int) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    outs = []
    for p in prompts:
        ids = tok(p, return_tensors="pt").input_ids
        gen = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                             pad_token_id=tok.pad_token_id)
        outs.append(gen[0, ids.shape[1]:].tolist())
    return outs


def test_embedded_model_greedy_equals_transformers_alone_and_among_32(embedded_model):
    want = hf_greedy(embedded_model, PROMPTS, 24)
    llm = LLM(threads=1)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    crowd_prompts = PROMPTS + [f"Section {i}: the" for i in range(27)]
    crowd = [o.outputs[0].token_ids for o in llm.generate(crowd_prompts, params)][:5]
    assert alone == want
    assert crowd == want


def test_default_llm_writes_text_from_the_embedded_model(embedded_model):
    out = LLM(threads=1).generate(["The list type"], SamplingParams(max_tokens=40, temperature=0))[0]
    text = out.outputs[0].text
    assert len(text.split()) >= 5
    assert sum(c.isalpha() or c.isspace() for c in text) / len(text) > 0.7


def test_prompt_logprobs_cover_every_prompt_token_after_the_first(embedded_model):
    llm = LLM(threads=1)
    out = llm.generate(["The list type is mutable"], SamplingParams(max_tokens=1, prompt_logprobs=3))[0]
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
    assert all(len(lp.top) == 3 for lp in out.prompt_logprobs[1:])


def test_token_id_prompts_and_per_prompt_params(embedded_model):
    llm = LLM(threads=1)
    ids = llm.tokenizer.encode("The dict type")
    outs = llm.generate([ids, "The dict type"], [SamplingParams(max_tokens=5, temperature=0),
                                                 SamplingParams(max_tokens=3, temperature=0)])
    assert outs[0].prompt_token_ids == outs[1].prompt_token_ids == ids
    assert outs[1].outputs[0].token_ids == outs[0].outputs[0].token_ids[:3]


def test_detokenizing_during_the_next_step_as_on_cuda_changes_no_output(embedded_model, monkeypatch):
    # On CUDA generate() detokenizes a step's outputs while the device runs the next one, so a
    # stop string aborts its sequence a step late: the extra token must never show.
    greedy = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    stop = LLM(threads=1).generate(PROMPTS[:1], greedy)[0].outputs[0].text[8:12]
    params = [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[stop]),
              SamplingParams(n=2, max_tokens=20, temperature=1.0, seed=5, logprobs=2, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0, prompt_logprobs=1)]

    def outputs(llm: LLM) -> list:
        return [(o.prompt_logprobs, [(c.text, c.token_ids, c.logprobs, c.finish_reason, c.stop_reason)
                                     for c in o.outputs]) for o in llm.generate(PROMPTS[:3], params)]

    want = outputs(LLM(threads=1))
    assert want[0][1][0][3:] == ("stop", stop)
    monkeypatch.setattr(ModelRunner, "asynchronous", property(lambda self: True))
    llm = LLM(threads=1)
    assert outputs(llm) == want
    assert llm.core.blocks.num_free_blocks == llm.core.blocks.num_blocks


def test_two_tensor_parallel_ranks_write_what_one_does_and_shutdown_ends_them(embedded_model):
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(threads=1, dtype="float32").generate(PROMPTS, params)]
    with LLM(tensor_parallel_size=2, dtype="float32") as llm:
        pids = llm.core.runner.tp.worker_pids
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    assert got == want
    assert len(pids) == 1 and not Path(f"/proc/{pids[0]}").exists()


def test_an_llm_dropped_without_shutdown_ends_its_ranks(embedded_model):
    llm = LLM(tensor_parallel_size=2)
    pids = llm.core.runner.tp.worker_pids
    del llm
    assert not Path(f"/proc/{pids[0]}").exists()
