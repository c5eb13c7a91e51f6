"""The zoo's byte-level BPE tokenizer (trained with ``tokenizers``, deterministic).

Special tokens take the first ids: ``<|endoftext|>`` (id 0: end of document,
also used as bos and pad) and the chat role markers ``<|system|>``,
``<|user|>``, ``<|assistant|>``. The chat template renders each message as
``<|role|>\\n{content}\\n`` and, with ``add_generation_prompt``, ends with
``<|assistant|>\\n``.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS_TOKEN = "<|endoftext|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (EOS_TOKEN, *ROLE_TOKENS)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE tokenizer of exactly ``vocab_size`` tokens.

    Deterministic for the same texts: the trainer breaks frequency ties by
    the pair itself, and no randomness is involved.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        max_token_length=16,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def hf_tokenizer(tok: Tokenizer, model_max_length: int):
    """Wrap a trained tokenizer as ``transformers.PreTrainedTokenizerFast``."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        bos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        unk_token=None,
        additional_special_tokens=list(ROLE_TOKENS),
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf
