"""Hugging Face transformers interop with real checkpoints and real transformers models: the
exported directory computes megatron-core's logits, and its validation loss is the run's."""

from __future__ import annotations

import base64
import io
import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from recipes.config.model import ModelConfig
from resiliency.hf.convert import from_hf, join_qkv, split_qkv, to_hf
from tests.helpers import REPO, TORCHRUN, run_pretrain

transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")

LLAMA_STYLE = [
    "model.normalization=RMSNorm",
    "model.activation=swiglu",
    "model.add_bias_linear=false",
    "model.num_query_groups=2",
]
# The byte tokenizer's 258 ids, unpadded (TP 1 and 2 divide it): an export drops padded rows,
# which would change the softmax the run computed; without them the loss must be the run's.
UNPADDED = ["model.padded_vocab_size=258"]


# name: (recipe, layout and form it trains and saves at, layout megatron's logits are read at)
def _exhaustive_if(family: str, exhaustive: bool) -> object:
    return pytest.param(family, marks=[pytest.mark.exhaustive] * exhaustive)


FAMILIES = {
    "llama": (
        "gpt_tiny",
        [
            "parallel.tp=1",
            "checkpoint.optim_format=dp_reshardable",
            *LLAMA_STYLE,
            "model.share_embeddings_and_output_weights=false",
        ],
        ["parallel.tp=2", *LLAMA_STYLE, "model.share_embeddings_and_output_weights=false"],
    ),
    "mixtral": (
        "gpt_tiny_moe",
        ["parallel.tp=1", "parallel.ep=2", *LLAMA_STYLE],
        ["parallel.tp=1", "parallel.ep=1", *LLAMA_STYLE],
    ),
    "gpt_neox": ("gpt_tiny", ["parallel.tp=2"], ["parallel.tp=1", "parallel.ep=1"]),
}
TOKENS = [
    [3, 70, 101, 200, 32, 17, 255, 9, 44, 100, 101, 102],
    [256, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11],
]


def hf_cli(*args: str, umask: int = -1) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "resiliency.hf", *args],
        cwd=REPO,
        env=env,
        text=True,
        capture_output=True,
        timeout=300,
        umask=umask,
    )


def train(recipe: str, layout: list[str], corpus: str, out: Path, run_id: str) -> Path:
    run_pretrain(
        2,
        [
            f"recipe={recipe}",
            f"data.paths=[{corpus}]",
            f"output_dir={out}",
            f"run_id={run_id}",
            "train.train_steps=4",
            "train.micro_batch_size=2",
            "train.global_batch_size=8",
            "checkpoint.save_interval=4",
            "train.eval_interval=4",
            "train.eval_iters=2",
            *UNPADDED,
            *layout,
        ],
    )
    return out / run_id / "steps" / "step-000000004"


def megatron_logits(
    step_dir: Path, recipe: str, layout: list[str], corpus: str, tmp: Path
) -> torch.Tensor:
    out = tmp / "megatron_logits.pt"
    nproc = 2 if "parallel.tp=2" in layout else 1
    cmd = [
        TORCHRUN,
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(REPO / "tests" / "workers" / "megatron_logits.py"),
        "--out",
        str(out),
        "--step-dir",
        str(step_dir),
        "--tokens",
        json.dumps(TOKENS),
        f"recipe={recipe}",
        f"data.paths=[{corpus}]",
        f"output_dir={tmp}",
        "run_id=logits",
        "checkpoint.enabled=false",
        f"launch.nproc_per_node={nproc}",
        *UNPADDED,
        *layout,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, cwd=REPO, env=env, text=True, capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out)


# gpt_neox's mapping in `make test-all` only (a CI-time budget); llama and mixtral by default.
@pytest.mark.parametrize("family", [_exhaustive_if(f, f == "gpt_neox") for f in FAMILIES])
def test_export_computes_megatrons_logits(family: str, stdlib_corpus: str, tmp_path: Path) -> None:
    recipe, saved_at, read_at = FAMILIES[family]
    step_dir = train(recipe, saved_at, stdlib_corpus, tmp_path, f"hf-{family}")
    out = tmp_path / "hf"
    proc = hf_cli("export", str(step_dir), "--out", str(out), "--check")
    assert proc.returncode == 0, proc.stderr[-4000:]
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == family and config["vocab_size"] == 258
    # The run's validation loss, recomputed by transformers on the same batches.
    assert "vs run" in proc.stdout and ": ok" in proc.stdout, proc.stdout
    hf_loss, run_loss = (
        float(x) for x in re.findall(r"(?:transformers|run) ([0-9.]+)", proc.stdout)
    )
    assert hf_loss == pytest.approx(run_loss, rel=1e-5)

    expected = megatron_logits(step_dir, recipe, read_at, stdlib_corpus, tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(TOKENS)).logits
    assert logits.shape == (2, len(TOKENS[0]), 258)
    torch.testing.assert_close(logits, expected[..., :258], rtol=1e-5, atol=1e-5)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer("héllo")["input_ids"] == list("héllo".encode())
    assert tokenizer.eos_token_id == 256


def _tiny(**fields: object) -> ModelConfig:
    base = dict(num_layers=2, hidden_size=16, num_attention_heads=4, ffn_hidden_size=24)
    return ModelConfig(**{**base, **fields})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "model",
    [
        _tiny(
            normalization="RMSNorm",
            activation="swiglu",
            num_query_groups=2,
            add_bias_linear=True,
            share_embeddings_and_output_weights=False,
        ),
        _tiny(
            normalization="RMSNorm",
            activation="swiglu",
            add_bias_linear=False,
            num_experts=3,
            moe_ffn_hidden_size=8,
        ),
        _tiny(),
    ],
    ids=["llama-bias-gqa", "mixtral", "gpt_neox"],
)
def test_megatron_to_hf_and_back_is_exact(model: ModelConfig) -> None:
    torch.manual_seed(0)
    hf = to_hf(_random_megatron(model, padded=40), model, vocab_size=33)
    back = to_hf(from_hf(hf, model, padded_vocab=40), model, vocab_size=33)
    assert hf.keys() == back.keys()
    for key in hf:
        assert torch.equal(hf[key], back[key]), key


def _random_megatron(model: ModelConfig, padded: int) -> dict[str, torch.Tensor]:
    """Random global tensors under megatron's checkpoint keys, built by from_hf's inverse."""
    from resiliency.hf.convert import LAYERS

    h, L = model.hidden_size, model.num_layers
    groups = model.num_query_groups or model.num_attention_heads
    qkv = (model.num_attention_heads + 2 * groups) * (h // model.num_attention_heads)
    ffn = model.ffn_hidden_size or 4 * h
    out = {
        "embedding.word_embeddings.weight": torch.randn(padded, h),
        "output_layer.weight": torch.randn(padded, h),
        "decoder.final_layernorm.weight": torch.randn(h),
    }
    layer = {
        "self_attention.linear_qkv.layer_norm_weight": (h,),
        "self_attention.linear_qkv.weight": (qkv, h),
        "self_attention.linear_proj.weight": (h, h),
        "mlp.linear_fc1.layer_norm_weight": (h,),
    }
    swiglu = 2 if model.activation == "swiglu" else 1
    if model.is_moe:
        e, f = model.num_experts or 0, model.moe_ffn_hidden_size or ffn
        layer |= {
            "mlp.router.weight": (e, h),
            "mlp.experts.experts.linear_fc1.weight": (e, 2 * f, h),
            "mlp.experts.experts.linear_fc2.weight": (e, h, f),
        }
    else:
        layer |= {"mlp.linear_fc1.weight": (swiglu * ffn, h), "mlp.linear_fc2.weight": (h, ffn)}
    if model.add_bias_linear:
        layer |= {
            "self_attention.linear_qkv.bias": (qkv,),
            "self_attention.linear_proj.bias": (h,),
            "mlp.linear_fc1.bias": (swiglu * ffn,),
            "mlp.linear_fc2.bias": (h,),
        }
    if model.normalization == "LayerNorm":
        layer |= {
            "self_attention.linear_qkv.layer_norm_bias": (h,),
            "mlp.linear_fc1.layer_norm_bias": (h,),
        }
        out["decoder.final_layernorm.bias"] = torch.randn(h)
    out |= {LAYERS + name: torch.randn(L, *shape) for name, shape in layer.items()}
    return out


def test_qkv_split_is_megatrons_group_layout() -> None:
    # 4 query heads in 2 groups, head dim 1: rows are q0 q1 k0 v0 | q2 q3 k1 v1.
    fused = torch.arange(8.0).unsqueeze(1)
    q, k, v = split_qkv(fused, heads=4, groups=2)
    assert q.flatten().tolist() == [0, 1, 4, 5]
    assert k.flatten().tolist() == [2, 6] and v.flatten().tolist() == [3, 7]
    assert torch.equal(join_qkv(q, k, v, heads=4, groups=2), fused)


# A transformers model with gpt_tiny's shape in Llama/Mixtral form, made here (no hub access).
def _hf_model(family: str, path: Path, vocab_size: int = 258) -> None:
    torch.manual_seed(7)
    common = dict(vocab_size=vocab_size, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5,
                  tie_word_embeddings=False, rope_theta=10000.0)  # fmt: skip
    if family == "llama":
        model = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(**common, intermediate_size=256)
        )
    else:
        config = transformers.MixtralConfig(
            **common, intermediate_size=128, num_local_experts=4, num_experts_per_tok=2
        )
        model = transformers.MixtralForCausalLM(config)
    model.save_pretrained(path)


IMPORTED = {
    "llama": ["recipe=gpt_tiny", *LLAMA_STYLE, "model.share_embeddings_and_output_weights=false"],
    "mixtral": ["recipe=gpt_tiny_moe", *LLAMA_STYLE,
                "model.share_embeddings_and_output_weights=false"],
}  # fmt: skip


# mixtral's import in `make test-all` only: its export (above) checks the expert mapping.
@pytest.mark.parametrize("family", [_exhaustive_if(f, f == "mixtral") for f in IMPORTED])
def test_import_round_trips_and_continues_with_transformers_loss(
    family: str, stdlib_corpus: str, tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    source = tmp_path / "source"
    _hf_model(family, source)
    run = [*IMPORTED[family], *UNPADDED, f"data.paths=[{stdlib_corpus}]",
           f"output_dir={tmp_path}", "run_id=continued"]  # fmt: skip
    proc = hf_cli("import", str(source), *run)
    assert proc.returncode == 0, proc.stderr[-4000:]
    step0 = tmp_path / "continued" / "steps" / "step-000000000"
    assert json.loads((step0 / "manifest.json").read_text())["weights_only"] is True

    # import -> export: the same tensors, bit for bit; from a copy of the run under another
    # name (its steps' manifests say which run they are), and refused for another --run-id.
    copied = tmp_path / "copied"
    shutil.copytree(tmp_path / "continued", copied)
    proc = hf_cli("export", str(copied / "steps" / step0.name), "--out", str(tmp_path / "back"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "records run 'continued', its run dir is named 'copied'" in proc.stderr
    wrong = hf_cli("export", str(step0), "--out", str(tmp_path / "no"), "--run-id", "another")
    assert wrong.returncode != 0 and "does not verify" in wrong.stderr, wrong.stderr[-2000:]
    original = load_file(str(source / "model.safetensors"))
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert original.keys() == back.keys()
    assert all(torch.equal(original[k], back[k]) for k in original)

    # Continued pretraining at another layout (TP=2, or EP=2): its first loss is the one
    # transformers computes for the same batch. llama: a run of its own warm-started from the
    # import (checkpoint.init_from); mixtral: the imported run itself, resumed.
    layout = ["parallel.tp=2"] if family == "llama" else ["parallel.ep=2"]
    steps = ["train.train_steps=1", "train.micro_batch_size=2", "train.global_batch_size=8"]
    run_id, says = "continued", "FRESH optimizer state"
    if family == "llama":
        run_id, says = "warm", "loaded (weights, fresh optimizer)"
        run = [*run[:-1], f"run_id={run_id}", f"checkpoint.init_from={tmp_path / 'continued'}"]
    proc = run_pretrain(2, [*run, *layout, *steps])
    assert says in proc.stderr
    first = json.loads((tmp_path / run_id / "metrics" / "steps.jsonl").read_text()
                       .splitlines()[0])  # fmt: skip
    assert first["step"] == 1
    expected = _transformers_first_batch_loss(source, [*run, *layout, *steps], tmp_path)
    assert first["loss"] == pytest.approx(expected, rel=1e-5)


def _transformers_first_batch_loss(model_dir: Path, overrides: list[str], tmp: Path) -> float:
    import torch.nn.functional as F

    from pretrain.data import dataset as data
    from pretrain.data.dataset import split_sizes
    from pretrain.data.tokenizer import ByteTokenizer
    from recipes import load_config

    run = load_config(overrides)
    mbs, gbs = run.train.micro_batch_size, run.train.global_batch_size
    plan = data.BatchPlan(mbs, gbs // mbs, 1, 0)
    train, _, _ = data.build_datasets(
        run.data,
        ByteTokenizer(),
        run.model.seq_length,
        split_sizes(run, plan),
        tmp / "continued" / "data-cache",
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    losses = []
    with torch.no_grad():
        for micro in data.microbatches(train, plan, 0):
            logits = model.eval()(input_ids=micro["tokens"]).logits
            per_token = F.cross_entropy(
                logits.flatten(0, 1), micro["labels"].flatten(), reduction="none"
            )
            mask = micro["loss_mask"].flatten().float()
            losses.append(float((per_token * mask).sum() / mask.sum()))
    return sum(losses) / len(losses)


def test_import_refuses_a_recipe_that_is_not_the_model(stdlib_corpus: str, tmp_path: Path) -> None:
    source = tmp_path / "source"
    _hf_model("llama", source)
    proc = hf_cli("import", str(source), "recipe=gpt_tiny", f"data.paths=[{stdlib_corpus}]",
                  f"output_dir={tmp_path}", "run_id=wrong")  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "model.normalization=LayerNorm (transformers: RMSNorm)" in errors[0]
    assert "model.activation=swiglu" in errors[0]  # the overrides that would match
    assert not (tmp_path / "wrong").exists()


def _library_tokenizer(kind: str, tmp: Path) -> Path:
    """A SentencePiece model or a megatron tiktoken vocabulary, made here."""
    if kind == "sentencepiece":
        import sentencepiece as spm

        model = io.BytesIO()
        texts = (REPO / "resiliency" / "hf" / "export.py").read_text().splitlines()
        spm.SentencePieceTrainer.train(sentence_iterator=iter(texts), model_writer=model,
                                       vocab_size=200, model_type="bpe", minloglevel=2)  # fmt: skip
        (tmp / "sp.model").write_bytes(model.getvalue())
        return tmp / "sp.model"
    merges = [b"th", b"the", b"de", b"def", b" def", b"in", b"ing", b"  ", b"    "]
    tokens = [bytes([i]) for i in range(256)] + merges
    entries = [{"rank": r, "token_bytes": base64.b64encode(t).decode(), "token_str": ""}
               for r, t in enumerate(tokens)]  # fmt: skip
    (tmp / "vocab.json").write_text(json.dumps(entries))  # the name a GPT-2 vocabulary has too
    return tmp / "vocab.json"


@pytest.mark.parametrize("kind", ["sentencepiece", "tiktoken"])
def test_export_of_a_sentencepiece_or_tiktoken_step_loads_in_transformers(
    kind: str, tmp_path: Path
) -> None:
    """A step whose tokenizer megatron-core's libraries read: published by import (step 0),
    exported by the CLI, loaded back by transformers: the weights bit for bit, the tokenizer
    encoding as the run's, every file 0644."""
    from safetensors.torch import load_file

    from pretrain.data.tokenizer import build_tokenizer

    path = _library_tokenizer(kind, tmp_path)
    run_tokenizer = build_tokenizer(kind, str(path))
    vocab = run_tokenizer.vocab_size
    source = tmp_path / "source"
    _hf_model("llama", source, vocab)
    data = ["data.kind=mock", "data.paths=[]", f"data.tokenizer={kind}",
            f"data.tokenizer_path={path}"]  # fmt: skip
    proc = hf_cli("import", str(source), *IMPORTED["llama"], f"model.padded_vocab_size={vocab}",
                  *data, f"output_dir={tmp_path}", "run_id=lib")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    step0 = tmp_path / "lib" / "steps" / "step-000000000"

    out = tmp_path / "hf"
    proc = hf_cli("export", str(step0), "--out", str(out), umask=0o022)
    assert proc.returncode == 0, proc.stderr[-4000:]
    files = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", path.name} <= files.keys()
    assert set(files.values()) == {0o644}, files

    original, exported = (
        load_file(str(source / "model.safetensors")),
        load_file(str(out / "model.safetensors")),
    )
    assert original.keys() == exported.keys()
    assert all(torch.equal(original[k], exported[k]) for k in original)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    for text in ["def export_step(step_dir: Path):\n    return  None", " naïve café", ""]:
        assert tokenizer(text)["input_ids"] == run_tokenizer.tokenize(text), text
    assert tokenizer.eos_token_id == run_tokenizer.eod
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = torch.tensor([run_tokenizer.tokenize("def main(argv)")])
    assert model(input_ids=ids).logits.shape == (1, ids.shape[1], vocab)

    if kind == "tiktoken":
        return
    # A usage problem after the step verified (here: --out under a regular file) is one line
    # and exit 2, never 1 ("the step does not verify").
    proc = hf_cli("export", str(step0), "--out", str(out / "config.json" / "sub"))
    assert proc.returncode == 2, proc.stderr[-4000:]
    errors = [line for line in proc.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "Not a directory" in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_an_unexpected_export_error_is_one_line_and_never_exit_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from resiliency.hf import cli, export

    def broken(*args: object) -> None:
        raise KeyError("a bug\nover two lines")

    monkeypatch.setattr(export, "export_step", broken)
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", root.handlers[:])  # main sets up logging: undone after
    monkeypatch.setattr(root, "level", root.level)
    code = cli.main(["export", str(tmp_path), "--out", str(tmp_path / "out")])
    assert code == cli.EXIT_INTERNAL == 70
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "export failed unexpectedly: KeyError" in lines[0], lines
