"""What the entry points take as input, in-process: a sweep only with -m (one line and exit 2
otherwise, nothing written), a sweep's run ids, --config FILE and --config-dir DIR (user
recipes outside the package), and a YAML syntax error named as file:line."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from launch.__main__ import main as launch_main
from pretrain.__main__ import main as pretrain_main
from pretrain.context import exit_codes
from recipes import ConfigError, load_config
from recipes.cli_args import parse_args, refuse_sweep, sweep_points, translate
from tests.helpers import USER_RECIPE

BAD_YAML = "train:\n  train_steps: [7\n  seed: 1\n"  # the flow list never closes


def _entry(entry: str, argv: list[str]) -> int:
    if entry == "pretrain":
        return pretrain_main(argv)
    backend, *flags = entry.split()
    return launch_main([backend, *flags, *argv])


def _one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    [line] = [ln for ln in err.splitlines() if "ERROR" in ln]
    return line


def _user_dir(tmp_path: Path, name: str = "mine", text: str = USER_RECIPE) -> Path:
    folder = tmp_path / "conf"
    (folder / "recipe").mkdir(parents=True, exist_ok=True)
    (folder / "recipe" / f"{name}.yaml").write_text(text)
    return folder


ENTRIES = ["pretrain", "local", "slurm --dry-run", "k8s --dry-run"]


@pytest.fixture()
def rendered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> Callable[[], list[dict]]:
    """The configs ``launch slurm --dry-run`` pinned, one per script path it printed (it
    renders beside the script; its default folder is a new one under tmp_path here)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def configs() -> list[dict]:
        scripts = [
            Path(ln) for ln in capsys.readouterr().out.splitlines() if ln.endswith(".sbatch")
        ]
        return [
            yaml.safe_load((s.parent.parent / "launch-config.yaml").read_text()) for s in scripts
        ]

    return configs


# ------------------------------------------------------------------ a sweep only with -m


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize(
    "value, says",
    [
        ("optimizer.lr=1e-3,3e-3", "write optimizer.lr=[1e-3,3e-3] for a list"),
        ("data.paths=a,b", "write data.paths=[a,b] for a list"),
        ("train.seed=range(3)", "train.seed=range(3) is a sweep: add -m"),
    ],
)
def test_a_sweep_value_without_m_is_one_line_and_exit_2(
    entry: str,
    value: str,
    says: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where a dry run would render
    argv = ["recipe=gpt_tiny", f"output_dir={tmp_path / 'runs'}", "run_id=x", value]
    assert _entry(entry, argv) == exit_codes.CONFIG_ERROR
    line = _one_line(capsys)
    assert says in line and "-m" in line, line
    assert not any(tmp_path.iterdir())  # refused before anything is written


def test_refuse_sweep_passes_lists_strings_and_non_overrides() -> None:
    refuse_sweep(["data.paths=[a,b]", "train.fault='kill@3,kill@5'", "logs", "NAME"])
    with pytest.raises(ConfigError, match="add -m"):
        refuse_sweep(["recipe=gpt_tiny", "+train.seed=choice(1,2)"])


def test_a_sweep_gives_an_explicit_run_id_one_run_per_point() -> None:
    points = sweep_points(["recipe=gpt_tiny", "run_id=lr", "optimizer.lr=1e-3,3e-3"])
    assert [p[-1] for p in points] == ["run_id=lr-0", "run_id=lr-1"]
    # a swept run_id names its points itself; one point keeps its name; none stays none
    swept = sweep_points(["run_id=a,b", "train.seed=1"])
    assert [[o for o in p if o.startswith("run_id")] for p in swept] == [["run_id=a"], ["run_id=b"]]
    assert sweep_points(["run_id=one", "train.seed=1"]) == [["run_id=one", "train.seed=1"]]
    assert all("run_id" not in " ".join(p) for p in sweep_points(["train.seed=1,2"]))


def test_launch_m_renders_one_job_per_point_under_derived_run_ids(
    tmp_path: Path, rendered: Callable[[], list[dict]]
) -> None:
    argv = ["slurm", "--dry-run", "-m", "recipe=gpt_tiny", "data=mock", f"output_dir={tmp_path}"]
    assert launch_main([*argv, "run_id=grid", "train.seed=1,2"]) == 0
    pinned = [(c["run_id"], c["train"]["seed"]) for c in rendered()]
    assert pinned == [("grid-0", 1), ("grid-1", 2)]


def test_launch_m_checks_every_point_before_the_first_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where a dry run would render
    argv = ["slurm", "--dry-run", "-m", "recipe=gpt_tiny", "data=mock", f"output_dir={tmp_path}"]
    assert launch_main([*argv, "run_id=g", "train.train_steps=5,abc"]) == 2
    assert "train.train_steps=abc: expected int" in _one_line(capsys)
    assert not any(tmp_path.iterdir())


def test_launch_refuses_an_option_it_does_not_know(capsys: pytest.CaptureFixture[str]) -> None:
    assert launch_main(["local", "--confg", "my.yaml", "recipe=gpt_tiny"]) == 2
    assert "unknown option '--confg' for launch local" in _one_line(capsys)


# ------------------------------------------------------------------ --config-dir, --config


def test_config_dir_adds_a_user_recipe(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], rendered: Callable[[], list[dict]]
) -> None:
    folder = _user_dir(tmp_path)
    assert pretrain_main(["--config-dir", str(folder), "recipe=mine", "--cfg", "job"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["train"]["train_steps"] == 7
    out = tmp_path / "runs"
    argv = ["slurm", "--dry-run", f"--config-dir={folder}", "recipe=mine", f"output_dir={out}"]
    assert launch_main([*argv, "run_id=u"]) == 0
    assert [c["train"]["train_steps"] for c in rendered()] == [7]


def test_hydra_searchpath_is_made_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _user_dir(tmp_path)
    monkeypatch.chdir(tmp_path)  # a relative folder: the same one in every later process
    [override] = translate(["hydra.searchpath=[file://conf]"])
    assert override == f"hydra.searchpath=['file://{tmp_path / 'conf'}']"
    assert load_config([override, "recipe=mine"]).train.train_steps == 7
    assert parse_args(["-cd", "conf"]).overrides == [override]


@pytest.mark.parametrize(
    "case, says",
    [
        ("missing", "is not a directory"),
        ("empty", "has none of the group folders"),
        ("shadows", "recipe/gpt_tiny.yaml: the package has recipe=gpt_tiny too"),
        ("no header", "a recipe file's first line is `# @package _global_`"),
    ],
)
def test_a_config_dir_mistake_is_one_line(
    case: str, says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = {
        "missing": lambda: tmp_path / "nowhere",
        "empty": lambda: tmp_path,
        "shadows": lambda: _user_dir(tmp_path, "gpt_tiny"),
        "no header": lambda: _user_dir(tmp_path, text="train:\n  train_steps: 7\n"),
    }[case]()
    recipe = "gpt_tiny" if case == "shadows" else "mine"
    assert pretrain_main(["--config-dir", str(folder), f"recipe={recipe}", "--cfg", "job"]) == 2
    assert says in _one_line(capsys)


@pytest.mark.parametrize("entry", ["pretrain", "local", "slurm --dry-run"])
def test_a_yaml_syntax_error_is_file_and_line(
    entry: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "my.yaml"
    bad.write_text(BAD_YAML)
    assert _entry(entry, ["--config", str(bad)]) == exit_codes.CONFIG_ERROR
    assert f"{bad}:3:7: YAML syntax error: expected ',' or ']'" in _one_line(capsys)
    folder = _user_dir(tmp_path, text=BAD_YAML)
    assert _entry(entry, ["--config-dir", str(folder), "recipe=mine"]) == 2
    assert f"{folder / 'recipe' / 'mine.yaml'}:3:7: YAML syntax error" in _one_line(capsys)


def test_launch_config_file_is_the_config_overrides_on_top(
    tmp_path: Path, rendered: Callable[[], list[dict]]
) -> None:
    """A run's pinned config (or `--cfg job --resolve`'s output) relaunched with a change."""
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump({"train": {"train_steps": 5}, "data": {"kind": "mock"}}))
    argv = ["slurm", "--dry-run", "--config", str(base), f"output_dir={tmp_path / 'runs'}"]
    assert launch_main([*argv, "run_id=f", "train.seed=9"]) == 0
    [pinned] = rendered()
    assert (pinned["train"]["train_steps"], pinned["train"]["seed"]) == (5, 9)
    assert load_config(["recipe=gpt_tiny"]).train.train_steps == 30  # only inside that command


@pytest.mark.parametrize("entry", ["pretrain", "local"])
def test_config_and_config_dir_together_are_refused(
    entry: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--config", "a.yaml", "--config-dir", str(_user_dir(tmp_path))]
    assert _entry(entry, argv) == exit_codes.CONFIG_ERROR
    assert "give one of them" in _one_line(capsys)
