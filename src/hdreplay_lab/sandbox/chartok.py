"""The sandbox's character-level tokenizer and a quiet-loading helper, shared by the text models (:mod:`.model`)
and the vision-language models (:mod:`.vlm`)."""

from __future__ import annotations

import contextlib

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
DEFAULT_CHARS = "0123456789+-*=?:;,. abcdefghijklmnopqrstuvwxyz()[]>"


def build_tokenizer(chars: str = DEFAULT_CHARS, specials: tuple[str, ...] = ()):
    """Character-level tokenizer; ``specials`` are extra single tokens (e.g. a VLM's image placeholders)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {PAD: 0, EOS: 1, UNK: 2}
    for c in chars:
        if c not in vocab:
            vocab[c] = len(vocab)
    for s in specials:
        vocab[s] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token=UNK,
                                   padding_side="left", truncation_side="left",
                                   **({"additional_special_tokens": list(specials)} if specials else {}))



@contextlib.contextmanager
def quiet_hf_progress():
    """Silence transformers' "Loading weights" / "Writing model shards" bars around one call, restoring the
    caller's setting: a tiny model loads in milliseconds and the bars would only break the comparison's."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
