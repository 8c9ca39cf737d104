"""SentencePiece models and megatron's tiktoken vocabularies as ``tokenizer.json``: what
transformers' fast tokenizers load, encoding text to the ids the run trained on.

- SentencePiece (BPE or Unigram): the model's own normalizer (its precompiled character map,
  extra-whitespace removal, whitespace escaping, the dummy prefix), its pieces and scores (BPE
  merges ranked by the merged piece's score, as SentencePiece merges), byte fallback, control
  pieces as special tokens and user-defined pieces kept whole.
- tiktoken: the Encoding megatron-core built (its split pattern, its mergeable ranks shifted
  past the special ids, its special tokens) as byte-level BPE whose merges are ranked by the
  merged token's rank, as tiktoken merges.

Tested against the run's own tokenizer on varied text (tests/unit/resiliency/test_hf_tokenizers.py).
Two differences stay, as in every transformers tokenizer: a control piece's literal text
(``</s>``) encodes as that special id, where SentencePiece encodes its characters; and a
Unigram model's equally scored segmentations may tie-break differently.
"""

from __future__ import annotations

import re
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE, Unigram

SPACE = "▁"  # SentencePiece's whitespace stand-in


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte: the alphabet of a byte-level tokenizer."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


class TokenizerConversionError(ValueError):
    """The tokenizer uses a feature with no tokenizer.json equivalent here."""


def sentencepiece_tokenizer(model_proto: bytes) -> Tokenizer:
    """``tokenizer.json`` of the serialized SentencePiece model ``model_proto``."""
    from sentencepiece import sentencepiece_model_pb2 as pb  # noqa: PLC0415 - optional extra

    proto = pb.ModelProto()
    proto.ParseFromString(model_proto)
    spec, norm = proto.trainer_spec, proto.normalizer_spec
    if spec.treat_whitespace_as_suffix:
        raise TokenizerConversionError(
            "the SentencePiece model treats whitespace as a suffix: no tokenizer.json form here"
        )
    piece = pb.ModelProto.SentencePiece
    user_defined = [p.piece for p in proto.pieces if p.type == piece.USER_DEFINED]
    tokenizer = Tokenizer(_spm_model(proto, pb, bool(user_defined)))
    tokenizer.normalizer = _spm_normalizer(norm)
    if user_defined:  # emitted whole and never merged, as SentencePiece does
        pattern = "|".join(re.escape(p) for p in sorted(user_defined, key=len, reverse=True))
        tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    tokenizer.decoder = _spm_decoder(spec, norm.add_dummy_prefix)
    control = [p.piece for p in proto.pieces if p.type == piece.CONTROL]
    tokenizer.add_special_tokens([AddedToken(p, normalized=False, special=True) for p in control])
    return tokenizer


def _spm_model(proto: Any, pb: Any, keep_pieces_whole: bool) -> BPE | Unigram:
    spec = proto.trainer_spec
    if spec.model_type == pb.TrainerSpec.UNIGRAM:
        vocab = [(p.piece, p.score) for p in proto.pieces]
        return Unigram(vocab, unk_id=spec.unk_id, byte_fallback=spec.byte_fallback)
    if spec.model_type != pb.TrainerSpec.BPE:
        kind = pb.TrainerSpec.ModelType.Name(spec.model_type)
        raise TokenizerConversionError(
            f"SentencePiece model type {kind} has no tokenizer.json form here (BPE and "
            "Unigram have)"
        )
    vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
    normal = {
        p.piece: (-p.score, i)
        for i, p in enumerate(proto.pieces)
        if p.type == pb.ModelProto.SentencePiece.NORMAL
    }
    ranked = sorted(
        (rank, token[:cut], token[cut:])
        for token, rank in normal.items()
        for cut in range(1, len(token))
        if token[:cut] in normal and token[cut:] in normal
    )
    return BPE(
        vocab=vocab,
        merges=[(left, right) for _, left, right in ranked],
        unk_token=spec.unk_piece,
        fuse_unk=True,
        byte_fallback=spec.byte_fallback,
        ignore_merges=keep_pieces_whole,
    )


def _spm_normalizer(norm: Any) -> normalizers.Normalizer:
    """SentencePiece's normalization, in its order."""
    steps: list[normalizers.Normalizer] = []
    if norm.precompiled_charsmap:
        steps.append(normalizers.Precompiled(norm.precompiled_charsmap))
    if norm.remove_extra_whitespaces:  # spaces only: newlines stay
        steps.append(normalizers.Replace(Regex(r"\A +| +\z"), ""))
        steps.append(normalizers.Replace(Regex(" {2,}"), " "))
    if norm.add_dummy_prefix:
        steps.append(normalizers.Prepend(" "))
    if norm.escape_whitespaces:
        steps.append(normalizers.Replace(" ", SPACE))
    return normalizers.Sequence(steps)


def _spm_decoder(spec: Any, dummy_prefix: bool) -> decoders.Decoder:
    # the unknown piece reads as SentencePiece writes it (" ⁇ " by default)
    steps: list[decoders.Decoder] = [
        decoders.Replace(spec.unk_piece, spec.unk_surface),
        decoders.Replace(SPACE, " "),
    ]
    if spec.byte_fallback:
        steps.append(decoders.ByteFallback())
    steps.append(decoders.Fuse())
    if dummy_prefix:  # the prefix's space, once, at the start of the text
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    return decoders.Sequence(steps)


def tiktoken_tokenizer(encoding: Any) -> Tokenizer:
    """``tokenizer.json`` of the ``tiktoken.Encoding`` megatron-core built for the run."""
    # tiktoken's own state, as transformers' tiktoken integration reads it
    ranks: dict[bytes, int] = encoding._mergeable_ranks
    specials: dict[str, int] = encoding._special_tokens
    alphabet = bytes_to_unicode()

    def text(token: bytes) -> str:
        return "".join(alphabet[b] for b in token)

    ranked = sorted(
        (rank, ranks[token[:cut]], token[:cut], token[cut:])
        for token, rank in ranks.items()
        for cut in range(1, len(token))
        if token[:cut] in ranks and token[cut:] in ranks
    )
    vocab = {text(token): i for token, i in ranks.items()} | specials
    model = BPE(
        vocab=vocab,
        merges=[(text(left), text(right)) for _, _, left, right in ranked],
        fuse_unk=False,
        ignore_merges=True,  # a whole pre-token in the vocabulary is one id, as in tiktoken
    )
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(encoding._pat_str), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    by_id = sorted(specials, key=specials.__getitem__)
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in by_id])
    return tokenizer
