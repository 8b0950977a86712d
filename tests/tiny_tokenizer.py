"""A tiny byte-level BPE tokenizer trained offline on a few sentences, saved next to a tiny checkpoint so text
prompts, chat templates and incremental detokenization can be tested without downloading anything."""

from __future__ import annotations

from pathlib import Path

SPECIAL = ["<pad>", "<s>", "</s>"]  # ids 0, 1, 2: the tiny models' pad, bos and eos
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A long prompt can stall the other users of a server.",
    "Chunked prefill keeps decodes flowing while a prompt is split into chunks.",
    "héllo wörld, naïve café, 世界 你好, emoji 🙂 and more",
] * 20
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant: {% endif %}")


def save_tiny_tokenizer(path: Path, vocab_size: int) -> Path:
    """Train a byte-level BPE of ``vocab_size`` ids (3 special, 256 bytes, the rest merges) into ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return path
