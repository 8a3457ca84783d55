"""Tiny randomly initialised Llama targets, built in the test, for CPU-fast checks."""
from __future__ import annotations

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, decoders
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from gumiho_core.target import Target

VOCAB = 96
EOS = 2


def tiny_tokenizer(vocab: int = VOCAB) -> PreTrainedTokenizerFast:
    words = {"<pad>": 0, "<bos>": 1, "<eos>": EOS}
    words.update({f"w{i}": i for i in range(3, vocab)})
    tok = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")
    return fast


def tiny_target(seed: int = 0, vocab: int = VOCAB, layers: int = 2, dtype=torch.float32, eos: bool = True,
                max_positions: int = 512, std: float = 0.15, tied: bool = False) -> Target:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        initializer_range=std,
        bos_token_id=1,
        eos_token_id=EOS if eos else None,
        pad_token_id=0,
        tie_word_embeddings=tied,
    )
    model = LlamaForCausalLM(config).to(dtype).eval()
    model.requires_grad_(False)
    if not eos:
        model.generation_config.eos_token_id = None
    tok = tiny_tokenizer(vocab)
    if not eos:
        tok.eos_token = None
    return Target(model=model, tokenizer=tok, name=f"tiny-llama-{seed}")


def random_prompts(n: int, seed: int = 1, vocab: int = VOCAB, lo: int = 3, hi: int = 20) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(lo, hi, (1,), generator=g))
        out.append([1] + torch.randint(3, vocab, (length,), generator=g).tolist())
    return out


def hf_greedy(target: Target, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy continuation: the reference every lossless test compares with."""
    out = target.model.generate(
        torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
    )
    return out[0, len(prompt):].tolist()


def assert_lossless(engine, prompts: list[list[int]], tree, max_new_tokens: int = 24) -> None:
    """Speculative == plain == transformers generate, token for token, on every prompt."""
    from gumiho_core import GenerationSettings, run_to_end

    for prompt in prompts:
        spec = run_to_end(engine, prompt, GenerationSettings(max_new_tokens=max_new_tokens, tree=tree))
        plain = run_to_end(engine, prompt, GenerationSettings(max_new_tokens=max_new_tokens, speculative=False))
        assert spec.token_ids == plain.token_ids == hf_greedy(engine.target, prompt, max_new_tokens)
