"""The air-gapped GPU check (bench/gpu_check.py, bench/gpu_wheels.py) on the CPU: its
arithmetic, its reading of runs, the wheel set's markers, the fixes its first GPU run found,
and (exhaustive: `make test-all`) every section at toy size, in this venv and in a clean
environment holding only the node's packages plus the carried wheels.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from importlib.metadata import distributions
from pathlib import Path

import pytest

from bench import gpu_check, gpu_wheels
from pretrain.fit.timing import resolve_save_interval
from recipes import load_config
from tests.helpers import REPO

pytestmark = pytest.mark.current_stack


def test_mfu_arithmetic_for_the_checked_model() -> None:
    # Megatron-LM's num_floating_point_operations for the Llama-3.2-1B shape at gbs 4, written
    # out: 12 B s L h^2 x (attention (1 + g/a + s/h) + SwiGLU MLP (ffn/h x 1.5) + logits V/(2Lh)).
    by_hand = 12 * 4 * 4096 * 16 * 2048**2 * ((1 + 8 / 32 + 4096 / 2048) + 4 * 1.5 + 128256 / 65536)
    run = load_config(gpu_check.Shape(False, 30).throughput_model())
    from pretrain.model.flops import flops_per_step

    assert flops_per_step(run.model, 4, 128256) == pytest.approx(by_hand, rel=1e-12)
    # the H200's measured figure: 1.4787e14 FLOP per 1.3694 s step is 108.0 TFLOP/s
    tflops = by_hand / 1.3694 / 1e12
    assert tflops == pytest.approx(107.98, abs=0.01)
    assert gpu_check.mfu(tflops, 773.2) == pytest.approx(tflops / 773.2)
    assert gpu_check.mfu(tflops, None) is None


def test_spread_and_throughput_leave_the_warmup_out() -> None:
    steps = {
        s: {
            "step_time_s": 9.0 if s <= 5 else 1.0 + s / 100,
            "tokens_per_s": 1.0,
            "tflops_per_device": 100.0,
        }
        for s in range(1, 16)
    }
    result = gpu_check.throughput_of(steps, 800.0, 1000.0)
    assert result["steps_timed"] == 10
    assert result["step_time_s"]["max"] == pytest.approx(1.15)
    assert result["step_time_s"]["median"] == pytest.approx(1.105)
    assert (result["mfu_vs_measured_peak"], result["mfu_vs_datasheet"]) == (0.125, 0.1)


def test_attempts_split_where_the_step_goes_back(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics"
    metrics.mkdir()
    rows = [(s, 1.0) for s in range(1, 9)] + [(5, 1.0), (6, 2.0), (7, 1.0)]
    lines = [json.dumps({"step": s, "loss": v, "grad_norm": 0.5, "time": 0.0}) for s, v in rows]
    (metrics / "steps.jsonl").write_text("\n".join(lines) + "\n")
    before, after = gpu_check.read_attempts(tmp_path)
    assert sorted(before) == list(range(1, 9)) and sorted(after) == [5, 6, 7]
    reference = {s: {"loss": 1.0, "grad_norm": 0.5} for s in range(1, 9)}
    assert gpu_check.compare_trajectories(reference, before)["bit_exact"]
    diff = gpu_check.compare_trajectories(reference, after)
    assert not diff["bit_exact"] and diff["first_differing_step"] == 6
    assert diff["max_abs_loss_diff"] == 1.0


def test_plan_comparison_splits_static_and_activations() -> None:
    gib = 1 << 30
    plan = {
        "memory": [
            {"weights": 2 * gib, "grads": 4 * gib, "optimizer": 14 * gib, "activations": 6 * gib}
        ]
    }
    real = {"allocated_gib": 21.0, "max_allocated_gib": 81.0, "max_reserved_gib": 86.0}
    result = gpu_check.compare_plan(plan, real)
    assert result["real_static_over_plan"] == pytest.approx(21 / 20)
    assert result["real_activations_over_plan"] == pytest.approx(60 / 6)


def test_wheel_markers_follow_the_node_python() -> None:
    assert gpu_wheels.applies("megatron-core==0.16.1; python_version < '3.12'") is None
    assert gpu_wheels.applies("megatron-core>=0.19.2,<0.20; python_version >= '3.12'") == (
        "megatron-core>=0.19.2,<0.20"
    )
    assert gpu_wheels.applies("pydantic; extra == 'api'") is None
    assert gpu_wheels.applies('importlib-resources ; python_version < "3.9"') is None
    names = {gpu_wheels.requirement_name(r) for r in gpu_wheels.runtime_requirements()}
    assert {"megatron-core", "nvidia-resiliency-ext", "hydra-core", "crc32c", "boto3"} <= names
    assert "torch" in gpu_wheels.node_packages()  # the node's own torch is used, never carried


def test_auto_save_interval_with_checkpointing_off_is_no_interval() -> None:
    # Found on the GPU: llama3_8b (save_interval=auto) with checkpoint.enabled=false and an
    # unknown vocabulary refused to start, although nothing would be saved.
    run = load_config(["recipe=llama3_8b", "checkpoint.enabled=false", "data.vocab_size=null"])
    assert resolve_save_interval(run).checkpoint.save_interval is None


def test_fused_kernels_need_their_extensions() -> None:
    # Found on the GPU: without apex / Megatron-LM's compiled softmax, megatron's local norm
    # asserts persist_layer_norm off and the fused softmax would ImportError at seq <= 4096;
    # a fused bias-dropout-add without dropout drew random numbers in compiled code.
    from pretrain.model import gpt as model

    code = textwrap.dedent(
        """
        from pretrain.platform import cpu_shim
        from pretrain.model import gpt as model
        from recipes import load_config
        cpu_shim.apply()
        run = load_config(["recipe=gpt_125m"])
        cfg = model.transformer_config(run.model, run.parallel, "cuda", True, run.perf, True)
        print(cfg.bias_dropout_fusion, cfg.masked_softmax_fusion, cfg.persist_layer_norm,
              cfg.deterministic_mode)
        """
    )
    if model.cuda_extension("apex") or model.cuda_extension("scaled_masked_softmax_cuda"):
        pytest.skip("the compiled extensions are installed here")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    # no dropout (gpt_125m): nothing to fuse, and the compiled kernel broke exact restarts
    assert out.stdout.split()[-4:] == ["False", "False", "False", "True"], out.stderr[-2000:]


def test_shim_leaves_torch_compile_rule_map_consistent() -> None:
    # Found on the GPU: `torch.cuda.manual_seed = torch.manual_seed` made torch 2.11's
    # torch.compile refuse one object under two rules (--plan on a host with CUDA).
    code = textwrap.dedent(
        """
        import torch
        from pretrain.platform import cpu_shim
        cpu_shim.apply()
        from torch._dynamo import trace_rules
        trace_rules.get_torch_obj_rule_map()
        objs = [torch.manual_seed, torch.cuda.manual_seed, torch.cuda.random.manual_seed]
        print(len({id(o) for o in objs}))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "3"


def _sections(out: Path) -> dict:
    report = json.loads((out / "gpu_check.json").read_text())
    return report["sections"]


@pytest.mark.slow
@pytest.mark.exhaustive
def test_dry_run_every_section(tmp_path: Path) -> None:
    """Every section at toy size on the CPU in under a minute of work; the resume is exact."""
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "bench.gpu_check",
        "--dry-run",
        "--out",
        str(out),
        "--runs-dir",
        str(tmp_path / "runs"),
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sections = _sections(out)
    assert list(sections) == list(gpu_check.SECTIONS)
    assert all(s["status"] == "ok" for s in sections.values())
    resume = sections["resume"]
    assert resume["killed"]["exit"] == -9 and resume["bit_exact"]
    assert resume["resumed_from_step"] == resume["killed"]["committed_step"]
    assert resume["same_state_saved_twice"]["compared"]


@pytest.mark.slow
@pytest.mark.exhaustive
def test_carried_wheels_cover_the_node(tmp_path: Path) -> None:
    """A venv holding only the node's packages (linked from this one) plus the wheels
    `make gpu-wheels` carries runs the check's resume section: nothing else is needed."""
    wheels = tmp_path / "whl"
    fetched = subprocess.run(
        [sys.executable, "-m", "bench.gpu_wheels", "--dest", str(wheels)],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert fetched.returncode == 0, fetched.stdout[-2000:] + fetched.stderr[-2000:]
    node = gpu_wheels.node_packages()
    packages = tmp_path / "node-packages"
    packages.mkdir()
    for dist in distributions():
        if gpu_wheels.canonical(dist.metadata["Name"]) not in node:
            continue
        for top in {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}:
            source, target = Path(dist.locate_file(top)), packages / top
            if source.exists() and not target.exists():
                target.symlink_to(source)
    venv = tmp_path / "venv"
    base = (
        Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    )
    subprocess.run([str(base), "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next((venv / "lib").glob("python*/site-packages"))
    (site / "node.pth").write_text(f"{packages}\n")
    env = {k: v for k, v in os.environ.items() if not re.match(r"PYTHON|VIRTUAL_ENV", k)}
    cmd = [
        str(venv / "bin" / "python"),
        "-m",
        "bench.gpu_check",
        "--dry-run",
        "--only",
        "resume",
        "--wheels",
        str(wheels),
        "--site",
        str(tmp_path / "site"),
        "--out",
        str(tmp_path / "out"),
        "--runs-dir",
        str(tmp_path / "runs"),
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _sections(tmp_path / "out")["resume"]["bit_exact"]
