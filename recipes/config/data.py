"""The training data and its tokenizer (``data.*``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from recipes.checks import one_of, require


@dataclass(kw_only=True)
class DataConfig:
    # indexed: megatron .bin/.idx prefixes in `paths`; mock: mcore's MockGPTDataset (smoke only)
    kind: str = "mock"
    paths: list[str] = field(default_factory=list)  # dataset prefixes: <prefix>.bin/.idx
    weights: Optional[list[float]] = None  # blend weights per path; None: by size
    split: str = "98,2,0"  # train,valid,test weights of each dataset
    # byte | huggingface | sentencepiece | tiktoken (as `pretrain.data.prepare --tokenizer`)
    tokenizer: str = "byte"
    # huggingface: a tokenizer.json or a local tokenizer directory; sentencepiece: a .model file;
    # tiktoken: a megatron tiktoken vocabulary .json; byte: none. Never downloaded.
    tokenizer_path: Optional[str] = None
    # The tokenizer's vocabulary size, known without its files: the planners (--plan, resiliency
    # plan) use it where the files are not (a laptop planning a cluster run); a run refuses a
    # tokenizer of another size. None: read from the tokenizer's files.
    vocab_size: Optional[int] = None
    cache_dir: Optional[str] = None  # None: <run dir>/data-cache
    seed: int = 1234  # sample shuffling seed of megatron's GPTDataset
    reset_position_ids: bool = False  # restart position ids after each eod
    reset_attention_mask: bool = False  # no attention across eod (document masking)
    eod_mask_loss: bool = False  # no loss on eod tokens
    # A resume compares each prefix's .idx checksum with the one its checkpoint recorded and
    # refuses a rebuilt corpus (its data cursor would select other samples); true: resume
    # anyway, the differences logged and in the attempt record.
    allow_changed_corpus: bool = False

    def __post_init__(self) -> None:
        one_of("data", "kind", self.kind, ("indexed", "mock"))
        # The same kinds as pretrain.data.tokenizer.TOKENIZER_KINDS
        # (tests/unit/pretrain/test_prepare.py checks).
        files = {
            "huggingface": "a tokenizer.json file or a local Hugging Face tokenizer directory",
            "sentencepiece": "a SentencePiece .model file",
            "tiktoken": "a megatron tiktoken vocabulary .json file",
        }
        one_of("data", "tokenizer", self.tokenizer, ("byte", *files))
        require(
            self.kind != "indexed" or len(self.paths) > 0,
            "data.kind=indexed needs data.paths (prefixes of .bin/.idx files made by "
            "`python -m pretrain.data.prepare`)",
        )
        require(
            self.weights is None or len(self.weights) == len(self.paths),
            f"data.weights has {len(self.weights or [])} entries for {len(self.paths)} data.paths",
        )
        require(
            self.tokenizer == "byte" or bool(self.tokenizer_path),
            f"data.tokenizer={self.tokenizer} needs data.tokenizer_path "
            f"({files.get(self.tokenizer)})",
        )
        require(
            self.tokenizer != "byte" or self.tokenizer_path is None,
            f"data.tokenizer_path={self.tokenizer_path!r} is not read by data.tokenizer=byte; "
            f"drop it or set data.tokenizer to one of {list(files)}",
        )
        parts = self.split.split(",")
        require(
            len(parts) == 3 and all(p.strip().replace(".", "", 1).isdigit() for p in parts),
            f"data.split={self.split!r} must be three comma-separated weights (train,valid,test)",
        )

    @property
    def split_weights(self) -> tuple[float, float, float]:
        train, valid, test = (float(p) for p in self.split.split(","))
        return train, valid, test
