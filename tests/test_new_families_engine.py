"""The newest families through the engine: a hybrid (Qwen3.5: Gated DeltaNet layers beside
attention, their per-sequence states kept in the state cache beside the paged KV) and Gemma 4
(layers of two attention shapes, the last ones attending over earlier layers' K/V, per-layer
inputs). Their answers are transformers' and the same bits however the engine schedules them
(other sequences in the batch, prompts split into chunks, sequences preempted and computed again,
prompts that start from a cached prefix and, for the hybrid, its kept state)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from tokenizer_fixtures import save_byte_level
from tokenizers import Tokenizer

from tailrace.llm import LLM
from tailrace.model.cpu.kernels import kernels
from tailrace.sampling_params import SamplingParams

PROMPTS = [[5, 17, 200, 3, 99, 42, 7, 128, 64, 11, 250, 33, 12, 9, 40, 41, 42, 43, 44, 45],
           [40, 41, 42, 43, 44], [300, 2, 301, 3, 302, 4, 303, 5, 304, 6, 305]]
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=2)


SHAPE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=128,
             max_position_embeddings=2048, initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2)
FAMILIES = {
    "qwen3_5": (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM,
                dict(num_hidden_layers=4, linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=2,
                     linear_num_value_heads=4)),
    # layers 2 and 5 global (heads twice as wide, their values their keys, one KV head), the rest
    # sliding over 8 positions; layers 4 and 5 attend over layers 3's and 2's K/V with double-wide
    # MLPs; per-layer inputs of 16; logits soft-capped
    "gemma4": (transformers.Gemma4TextConfig, transformers.Gemma4ForCausalLM,
               dict(num_hidden_layers=6, global_head_dim=64, attention_k_eq_v=True, num_global_key_value_heads=1,
                    num_kv_shared_layers=2, use_double_wide_mlp=True, hidden_size_per_layer_input=16,
                    sliding_window=8, final_logit_softcapping=30.0,
                    layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2)),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def checkpoint(request, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, transformers.PreTrainedModel]:
    config_class, model_class, extra = FAMILIES[request.param]
    directory = tmp_path_factory.mktemp(request.param)
    save_byte_level(directory)
    vocab = Tokenizer.from_file(str(directory / "tokenizer.json")).get_vocab_size()
    if request.param == "gemma4":
        extra = {**extra, "vocab_size_per_layer_input": vocab}
    config = config_class(vocab_size=vocab, **SHAPE, **extra)
    torch.manual_seed(0)
    model = model_class(config).float().eval()
    with torch.no_grad():  # norms and layer scalars away from 1, where a misplaced one shows
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.uniform_(0.5, 1.5)
    model.save_pretrained(directory)
    return directory, model


def answers(path: Path, prompts: list[list[int]], **engine: object) -> tuple[list[tuple], LLM]:
    """Each prompt's tokens and logprobs (the chosen and the top ones), all sent at once."""
    llm = LLM(str(path), dtype="float32", **engine)
    outputs = llm.generate(prompts, GREEDY)
    return [(o.outputs[0].token_ids, [(lp.logprob, lp.top) for lp in o.outputs[0].logprobs]) for o in outputs], llm


def test_greedy_tokens_are_transformers(checkpoint):
    path, model = checkpoint
    got, _ = answers(path, PROMPTS)
    for prompt, (tokens, _) in zip(PROMPTS, got):
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(GREEDY.max_tokens):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        assert tokens == ids[len(prompt):]


@pytest.mark.skipif(kernels() is None, reason="bit-for-bit sameness is the CPU kernels' (PyTorch's ops round by shape)")
def test_answers_are_the_same_bits_however_scheduled(checkpoint):
    path, _ = checkpoint
    alone = [answers(path, [prompt])[0][0] for prompt in PROMPTS]
    together, _ = answers(path, PROMPTS * 2)
    assert together == alone * 2
    chunked, _ = answers(path, PROMPTS, max_num_batched_tokens=7)  # prompts in chunks of up to 7 tokens
    assert chunked == alone
    # 12 blocks of 4 tokens hold the longest sequence (9 blocks) and little else: the newest is
    # preempted and computed again from its first token
    preempted, llm = answers(path, PROMPTS * 2, num_kv_blocks=12, block_size=4)
    assert llm.core.scheduler.num_preemptions > 0
    assert preempted == alone * 2


@pytest.mark.skipif(kernels() is None, reason="bit-for-bit sameness is the CPU kernels' (PyTorch's ops round by shape)")
def test_a_cached_prefix_and_its_kept_state_give_the_same_bits(checkpoint):
    """A 1,000-token shared prefix: the second prompt starts from the first's cached blocks (and a
    hybrid's state kept at the last block boundary inside its prefill); a follow-up turn (the
    first prompt, its answer and more) from the blocks (and state) of a boundary its decoding passed."""
    path, _ = checkpoint
    shared = [(i * 37 + 11) % 400 for i in range(1000)]
    first, second = shared + [5, 6, 7, 8, 9], shared + [70, 71, 72]
    llm = LLM(str(path), dtype="float32", max_num_seqs=4)
    reference = LLM(str(path), dtype="float32", max_num_seqs=4, enable_prefix_caching=False)
    for prompt in (first, second):
        assert llm.generate([prompt], GREEDY)[0].outputs[0] == reference.generate([prompt], GREEDY)[0].outputs[0]
    assert llm.core.blocks.prefix_cache_hits == 992  # 62 blocks of 16, the last whose state is kept
    answer = llm.generate([first], GREEDY)[0].outputs[0].token_ids
    follow_up = first + answer + [100, 101]
    hits = llm.core.blocks.prefix_cache_hits
    got, want = (engine.generate([follow_up], GREEDY)[0].outputs[0] for engine in (llm, reference))
    assert got == want
    assert llm.core.blocks.prefix_cache_hits - hits == (len(first) + len(answer)) // 16 * 16


def test_gemma4_prompts_stop_where_the_layers_that_store_no_kv_begin(checkpoint):
    """Past the first layer reading another's K/V, only the rows whose logits are wanted run: a
    prompt's last row (a chunk before the last, none), and the answer is transformers' still."""
    path, model = checkpoint
    if model.config.model_type != "gemma4_text":
        pytest.skip("Gemma 4's layers only")
    llm = LLM(str(path), dtype="float32", max_num_batched_tokens=8)
    layers = llm.core.runner.model.model.layers
    seen: dict[int, list[int]] = {3: [], 4: []}
    for index in seen:
        forward = layers[index].forward
        layers[index].forward = lambda h, *rest, index=index, forward=forward: (seen[index].append(len(h)),
                                                                                forward(h, *rest))[1]
    prompt = PROMPTS[0]  # 20 tokens: chunks of 8, 8 and 4
    tokens = llm.generate([prompt], GREEDY)[0].outputs[0].token_ids
    assert seen[3][:3] == [8, 8, 4] and seen[4] == [1] * (len(seen[3]) - 2)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(GREEDY.max_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    assert tokens == ids[len(prompt):]
