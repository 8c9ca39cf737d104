"""``pretrain.data.prepare --train-tokenizer VOCAB``: a byte-level BPE tokenizer trained on the corpus.

Trained with the ``tokenizers`` library (GPT-2's scheme: byte-level pre-tokenization, so every
input is encodable and no id is unknown) on the same documents that are then tokenized with it,
and saved as ``<tokenizer-path>/tokenizer.json``, the file ``data.tokenizer=huggingface`` reads.
Nothing is downloaded.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from pretrain.data.prepare.inputs import Item, item_texts

EOD_TOKEN = "<|endoftext|>"  # the end-of-document token the HF tokenizer loader looks for
MIN_VOCAB = 257  # the 256 byte symbols and the end-of-document token


def texts_of(items: Iterable[Item], keys: Sequence[str]) -> Iterator[str]:
    for item in items:
        for sequences in item_texts(item, keys):
            yield from sequences


def train_bpe(texts: Iterable[str], vocab_size: int, out_dir: Path) -> Path:
    """Train, then write ``out_dir/tokenizer.json`` atomically; its path."""
    # tokenizers: a dependency of the package, loaded only when a tokenizer is trained
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "tokenizer.json"
    tmp = path.with_suffix(".json.tmp")
    tokenizer.save(str(tmp))
    os.replace(tmp, path)
    return path
